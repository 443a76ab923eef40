#!/usr/bin/env python3
"""Tokenizer throughput, titan vs the Python `tokenizers` package (single thread, same documents).

  bench/tokenizer/bench.py [--tokenizer assets/tokenizer/tokenizer.json] [--mb 8] [--passes 3]

The documents are the CPython standard library's .py files (PSF License 2.0) of the running
interpreter, sorted by path, up to --mb megabytes: a mixture of English prose and code. Both sides
encode every document once cold (empty caches), then --passes times; the warm mean is reported.
"""
import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def documents(limit_bytes):
    stdlib = sysconfig.get_paths()["stdlib"]
    docs, total = [], 0
    for dirpath, dirnames, filenames in sorted(os.walk(stdlib)):
        dirnames.sort()
        if "site-packages" in dirpath or "test" in dirpath.split(os.sep):
            dirnames.clear()
            continue
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                text = f.read()
            docs.append(text)
            total += len(text.encode())
            if total >= limit_bytes:
                return docs
    return docs


def checksum(all_ids):
    c = 0
    for ids in all_ids:
        for i in ids:
            c = (c * 1000003 + i) % (1 << 64)
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "assets/tokenizer/tokenizer.json"))
    ap.add_argument("--mb", type=float, default=8)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--bench-binary", default=os.path.join(ROOT, "build/tokenizer_bench"))
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer

    docs = documents(int(args.mb * 1e6))
    nbytes = sum(len(d.encode()) for d in docs)
    tok = Tokenizer.from_file(args.tokenizer)
    t0 = time.perf_counter()
    ids = [tok.encode(d, add_special_tokens=False).ids for d in docs]
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.passes):
        ids = [tok.encode(d, add_special_tokens=False).ids for d in docs]
    warm = (time.perf_counter() - t0) / args.passes
    py = {"mb_per_s": nbytes / 1e6 / warm, "cold_mb_per_s": nbytes / 1e6 / cold,
          "tokens": sum(len(i) for i in ids), "checksum": checksum(ids)}

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(docs, f)
        docs_path = f.name
    try:
        out = subprocess.run([args.bench_binary, args.tokenizer, docs_path, str(args.passes)], check=True,
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    finally:
        os.remove(docs_path)
    titan = json.loads(out.strip().splitlines()[-1])
    same = titan["tokens"] == py["tokens"] and titan["checksum"] == py["checksum"]
    print(f"documents: {len(docs)}, {nbytes / 1e6:.2f} MB, tokens: {py['tokens']} (ids identical: {same})")
    print(f"titan      : {titan['mb_per_s']:.2f} MB/s warm, {titan['cold_mb_per_s']:.2f} MB/s cold")
    print(f"tokenizers : {py['mb_per_s']:.2f} MB/s warm, {py['cold_mb_per_s']:.2f} MB/s cold")
    print(f"ratio titan/tokenizers: {titan['mb_per_s'] / py['mb_per_s']:.2f}x warm, "
          f"{titan['cold_mb_per_s'] / py['cold_mb_per_s']:.2f}x cold")
    if not same:
        sys.exit("token ids differ between titan and tokenizers")


if __name__ == "__main__":
    main()
