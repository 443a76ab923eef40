#!/usr/bin/env python3
"""`titan tokenize` throughput on every core vs the `tokenizers` package's batch encoding, same cores.

  bench/tokenizer/parallel_bench.py [--threads 1,2] [--mb 16] [--repeats 3]

The documents are the CPython standard library's .py files (as bench.py reads them) written as one
JSON Lines file. For each thread count T:
  titan:      `titan tokenize --workers T` end to end (read the JSON Lines, tokenize with BOS/EOS, write
              the shards and manifest), wall time of the process;
  tokenizers: `Tokenizer.encode_batch(docs)` with RAYON_NUM_THREADS=T, the documents already in memory
              (no file reading, no writing), in a fresh process per measurement.
Both use assets/tokenizer/tokenizer.json. The median of --repeats runs is reported, as tokens/s and the
ratio titan / tokenizers (titan's figure includes its reading and writing, the peer's does not).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from bench import documents  # noqa: E402  (the same documents as the single-thread benchmark)

PEER = r"""
import json, os, sys, time
from tokenizers import Tokenizer
docs = [json.loads(l)["text"] for l in open(sys.argv[1])]
tok = Tokenizer.from_file(sys.argv[2])
start = time.perf_counter()
enc = tok.encode_batch(docs, add_special_tokens=False)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "tokens": sum(len(e.ids) for e in enc) + 2 * len(docs)}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--mb", type=float, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--titan", default=os.path.join(ROOT, "build/titan"))
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "assets/tokenizer"))
    args = ap.parse_args()
    docs = documents(int(args.mb * 1e6))
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "docs.jsonl")
        with open(data, "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        size = os.path.getsize(data)
        print(f"{len(docs)} documents, {size / 1e6:.2f} MB of JSON Lines; nproc {os.cpu_count()}; "
              f"load average {os.getloadavg()[0]:.1f}")
        print("| threads | titan tokenize (tokens/s) | tokenizers encode_batch (tokens/s) | ratio |")
        print("|---|---|---|---|")
        for t in [int(x) for x in args.threads.split(",")]:
            titan, peer, tokens = [], [], None
            for r in range(args.repeats):
                out = os.path.join(tmp, f"shards-{t}-{r}")
                start = time.perf_counter()
                subprocess.run([args.titan, "tokenize", "--output", out, "--workers", str(t), "--training.dataset", "c4",
                                "--training.dataset_path", data, "--model.hf_assets_path", args.tokenizer],
                               check=True, capture_output=True)
                seconds = time.perf_counter() - start
                tokens = json.load(open(os.path.join(out, "manifest.json")))["num_tokens"]
                titan.append(tokens / seconds)
                env = dict(os.environ, RAYON_NUM_THREADS=str(t), TOKENIZERS_PARALLELISM="true")
                res = subprocess.run([sys.executable, "-c", PEER, data, os.path.join(args.tokenizer, "tokenizer.json")],
                                     check=True, capture_output=True, text=True, env=env)
                p = json.loads(res.stdout)
                if p["tokens"] != tokens:
                    sys.exit(f"token counts differ: titan {tokens}, tokenizers {p['tokens']} (+ BOS/EOS)")
                peer.append(p["tokens"] / p["seconds"])
            a, b = statistics.median(titan), statistics.median(peer)
            print(f"| {t} | {a:,.0f} | {b:,.0f} | {a / b:.1f}x |")


if __name__ == "__main__":
    main()
