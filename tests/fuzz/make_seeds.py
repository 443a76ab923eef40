#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpus (tests/fuzz/corpus/<target>/) from the repository's configs,
test fixtures and tokenizers, kept small: trimmed tokenizers, tiny data files, a two-tensor checkpoint.

    .venv/bin/python tests/fuzz/make_seeds.py     # rewrites tests/fuzz/corpus/

Inputs that stand for several files join them with the separator of tests/fuzz/fuzz_util.h.
"""
import gzip
import json
import os
import shutil
import subprocess
import struct
import tempfile
import zlib
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests/fuzz/corpus"
SEP = b"\n--titan-fuzz-file--\n"


def put(target, name, data):
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def config_seeds():
    for p in sorted((ROOT / "configs").glob("*.toml")) + sorted((ROOT / "tests/unit/config/fixtures").glob("*.toml")):
        if p.name.endswith(".as_new.toml"):
            continue
        put("config", p.name, p.read_bytes())
    put("config", "cli_overrides", b"[training]\nsteps = 20\n" + SEP +
        b"--training.steps\n30\n--compile.enable\n--optimizer.lr=1.5e-4\n--parallelism.data_parallel_shard_degree\n-1\n"
        b"--checkpoint.no-initial-load-model-only\n--compile.components=model,loss\n")
    put("config", "legacy_keys", b"[training]\nbatch_size = 4\n[experimental]\npipeline_parallel_degree = 1\n"
        b"[float8]\nenable_float8_linear = false\n")


def small_hf_tokenizer():
    """The test tokenizer.json with its vocabulary cut to the byte alphabet and the merges it allows."""
    j = json.loads((ROOT / "assets/tokenizer/tokenizer.json").read_text())
    vocab = j["model"]["vocab"]
    keep = {t: i for t, i in vocab.items() if i < 320}
    merges = []
    for m in j["model"]["merges"]:
        a, b = m if isinstance(m, list) else m.split(" ")
        if a in keep and b in keep and a + b in keep:
            merges.append([a, b])
    j["model"]["vocab"] = keep
    j["model"]["merges"] = merges
    return j


def tokenizer_seeds():
    j = small_hf_tokenizer()
    put("tokenizer_hf", "small_tokenizer.json", json.dumps(j, ensure_ascii=False))
    put("tokenizer_hf", "with_config", json.dumps(j, ensure_ascii=False).encode() + SEP +
        json.dumps({"bos_token": {"content": "<|end_of_text|>"}, "eos_token": "<|begin_of_text|>"}).encode())
    j2 = dict(j)
    j2["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}
    j2["post_processor"] = {"type": "Sequence", "processors": [{"type": "ByteLevel"}, j["post_processor"]]}
    j2["model"] = dict(j["model"], merges=[" ".join(m) for m in j["model"]["merges"]], ignore_merges=False)
    put("tokenizer_hf", "gpt2_style.json", json.dumps(j2, ensure_ascii=False))
    lines = (ROOT / "assets/tokenizer/tiktoken.model").read_bytes().splitlines(keepends=True)
    put("tokenizer_tiktoken", "small.model", b"".join(lines[:300]))
    put("tokenizer_sentencepiece", "tiny_sentencepiece.model", tiny_sentencepiece())
    put("tokenizer_sentencepiece", "small.tiktoken", b"".join(lines[:260]))


def tiny_sentencepiece():
    import sentencepiece as spm
    with tempfile.TemporaryDirectory() as d:
        corpus = Path(d) / "c.txt"
        corpus.write_text("\n".join(["the quick brown fox jumps over the lazy dog", "hello world, hello titan",
                                     "pack my box with five dozen liquor jugs", "caf\u00e9 \u65e5\u672c\u8a9e"] * 20))
        spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=f"{d}/m", vocab_size=320, model_type="bpe",
                                       user_defined_symbols=["<|user|>"], byte_fallback=True,
                                       character_coverage=1.0, normalization_rule_name="identity", minloglevel=2)
        return Path(f"{d}/m.model").read_bytes()


def jsonl_plain():
    docs = [{"text": "The first document.\nIt has two lines.", "id": 1}, {"text": "", "url": "x"},
            {"text": "caf\u00e9 \u65e5\u672c \ud83d\ude00"}, {"text": "tab\tand \"quotes\"", "meta": {"a": [1, 2]}}]
    return ("\n".join(json.dumps(d) for d in docs) + "\n\n  \r\n" + json.dumps({"text": "last, no newline"})).encode()


def zstd_frame(data, blocks=1):
    """A zstd frame of stored (raw) blocks, with its content size and without a checksum."""
    out = b"\x28\xb5\x2f\xfd" + bytes([0xA0]) + struct.pack("<I", len(data))  # single segment, 4-byte size
    step = max(1, -(-len(data) // blocks))
    chunks = [data[i:i + step] for i in range(0, len(data), step)] or [b""]
    for k, c in enumerate(chunks):
        out += struct.pack("<I", (k == len(chunks) - 1) | (len(c) << 3))[:3] + c
    return out


def data_seeds():
    plain = jsonl_plain()
    put("jsonl", "plain.jsonl", plain)
    put("jsonl", "crlf.jsonl", plain.replace(b"\n", b"\r\n"))
    put("jsonl", "two_members.jsonl.gz", gzip.compress(plain[:60], mtime=0) + gzip.compress(plain[60:], mtime=0))
    put("jsonl", "two_frames.jsonl.zst", zstd_frame(plain[:50]) + zstd_frame(plain[50:], blocks=3))
    if shutil.which("zstd"):  # a compressed (not only stored) frame
        put("jsonl", "compressed.jsonl.zst", subprocess.run(["zstd", "-q", "-c", "-3"], input=plain + b"\n" + plain,
                                                           capture_output=True, check=True).stdout)

    # Token shards as `titan tokenize` writes them (token_shards.h), for a tokenizer of vocabulary 2048,
    # bos 0, eos 1.
    def shard(docs):
        tokens = [t for d in docs for t in d]
        starts, n = [], 0
        for d in docs:
            starts.append(n)
            n += len(d)
        head = b"TITANTOK" + struct.pack("<IIQQQ", 1, 4, len(tokens), len(docs), 2048)
        body = head.ljust(64, b"\0") + struct.pack(f"<{len(tokens)}I", *tokens)
        body += b"\0" * ((-len(body)) % 8)
        return body + struct.pack(f"<{len(starts)}Q", *starts)

    docs0 = [[0, 17, 300, 2047, 1], [0, 5, 6, 1]]
    docs1 = [[0] + list(range(100, 130)) + [1]]
    manifest = {"format": "titan-token-shards", "version": 1, "num_tokens": 9 + 32, "num_documents": 3,
                "tokenizer": {"vocab_size": 2048, "bos_id": 0, "eos_id": 1, "name": "assets/tokenizer"},
                "text_field": "text", "sources": ["data.jsonl"],
                "shards": [{"file": "shard-00000.bin", "num_tokens": 9, "num_documents": 2},
                           {"file": "shard-00001.bin", "num_tokens": 32, "num_documents": 1}]}
    put("token_shards", "two_shards", json.dumps(manifest, indent=2).encode() + SEP + shard(docs0) + SEP + shard(docs1))
    one = dict(manifest, num_tokens=9, num_documents=2, shards=manifest["shards"][:1])
    put("token_shards", "one_shard", json.dumps(one).encode() + SEP + shard(docs0))

    # Other frameworks' token files (token_files.h). The first byte chooses the format (bit 0: 0
    # Megatron-LM, 1 llm.c) and the vocabulary (bit 1: 0 for 2048 tokens, 1 for 128256).
    def megatron(docs, code, fmt):
        tokens = [t for d in docs for t in d]
        idx = b"MMIDIDX\0\0" + struct.pack("<QBQQ", 1, code, len(docs), len(docs) + 1)
        idx += struct.pack(f"<{len(docs)}i", *[len(d) for d in docs])
        offsets, n = [], 0
        for d in docs:
            offsets.append(n * struct.calcsize(fmt))
            n += len(d)
        idx += struct.pack(f"<{len(docs)}q", *offsets) + struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1))
        return idx + SEP + struct.pack(f"<{len(tokens)}{fmt}", *tokens)

    def llmc(tokens, magic, version, fmt):
        return struct.pack("<3i", magic, version, len(tokens)) + b"\0" * (256 * 4 - 12) + \
            struct.pack(f"<{len(tokens)}{fmt}", *tokens)

    docs = docs0 + docs1
    put("token_files", "megatron_uint16", b"\x00" + megatron(docs, 8, "H"))
    put("token_files", "megatron_int32", b"\x02" + megatron([[t * 60 for t in d] for d in docs], 4, "i"))
    put("token_files", "llmc_gpt2", b"\x01" + llmc([t for d in docs for t in d], 20240520, 1, "H"))
    put("token_files", "llmc_llama3", b"\x03" + llmc([t * 60 for d in docs for t in d], 20240801, 7, "I"))


def safetensors_file(entries, metadata):
    """entries: [(name, dtype, shape, raw bytes)] -> (file bytes, [crc32 of each entry])."""
    header, offset = {"__metadata__": metadata}, 0
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((-len(text)) % 8)
    data = struct.pack("<Q", len(text)) + text.encode() + b"".join(e[3] for e in entries)
    return data, [zlib.crc32(e[3]) for e in entries]


def dumps(j):  # nlohmann::json::dump() of simple values: compact, keys sorted
    return json.dumps(j, separators=(",", ":"), sort_keys=True)


def checkpoint_seeds():
    # Two ranks, each holding half of the rows of "model.w" (4 x 3, F32) and rank 0 all of "model.b" (BF16).
    w = struct.pack("<12f", *[float(i) - 5.5 for i in range(12)])
    b = struct.pack("<3H", 0x3F80, 0x4000, 0xC040)
    ranks = [[("model.w", "F32", [2, 3], w[:24], [0, 0]), ("model.b", "BF16", [3], b, [0])],
             [("model.w", "F32", [2, 3], w[24:], [2, 0])]]
    global_shapes = {"model.w": [4, 3], "model.b": [3]}
    files, tensors, blobs = {}, {}, []
    for r, entries in enumerate(ranks):
        name = f"rank-{r:05d}.safetensors"
        slices = {e[0]: {"global_shape": global_shapes[e[0]], "begin": e[4]} for e in entries}
        data, crcs = safetensors_file([e[:4] for e in entries], {"format": "pt", "titan_slices": dumps(slices)})
        blobs.append(data)
        files[name] = {"bytes": len(data), "crc32": zlib.crc32(data)}
        for e, crc in zip(entries, crcs):
            t = tensors.setdefault(e[0], {"dtype": e[1], "shape": global_shapes[e[0]], "slices": []})
            t["slices"].append({"file": name, "begin": e[4], "length": e[2], "crc32": crc})
    info = {"step": 1, "model": {"name": "llama3", "flavor": "debugmodel"}, "contents": ["model"], "layout": "fsdp 2"}
    state = {"train_state": {"step": 1}, "dataloader": {"kind": "text", "windows": 3}}
    index = {"format": "titan-checkpoint", "version": 1, "info": info, "state": state,
             "info_state_crc32": zlib.crc32((dumps(info) + "\n" + dumps(state)).encode()),
             "files": files, "tensors": tensors}
    put("checkpoint", "two_ranks", json.dumps(index, indent=1).encode() + SEP + blobs[0] + SEP + blobs[1])
    # Version 2: index.json names the data files and, per tensor, the ranges of files holding it; each
    # data file has its own slice index.
    subs, files2 = [], {}
    for r, entries in enumerate(ranks):
        name = f"rank-{r:05d}"
        crcs = [zlib.crc32(e[3]) for e in entries]
        sl = {e[0]: {"dtype": e[1], "shape": global_shapes[e[0]], "begin": e[4], "length": e[2], "crc32": c}
              for e, c in zip(entries, crcs)}
        sub = dumps({"format": "titan-checkpoint-slices", "version": 1, "data": name + ".safetensors", "slices": sl}).encode()
        subs.append(sub)
        files2[name + ".safetensors"] = files[name + ".safetensors"]
        files2[name + ".slices.json"] = {"bytes": len(sub), "crc32": zlib.crc32(sub)}
    tensors2 = {"model.w": {"dtype": "F32", "shape": [4, 3], "shards": [[0, 2]]},
                "model.b": {"dtype": "BF16", "shape": [3], "shards": [[0, 1]]}}
    index2 = dict(index, version=2, files=files2, shards=["rank-00000", "rank-00001"], tensors=tensors2)
    put("checkpoint", "two_ranks_v2", json.dumps(index2, indent=1).encode() + SEP + blobs[0] + SEP + blobs[1] + SEP +
        subs[0] + SEP + subs[1])
    # Names that would reach outside the folder: refused as not plain file names.
    escape = dict(index2, shards=["../rank-00000", "rank-00001"])
    put("checkpoint", "escaping_shard_name", json.dumps(escape, indent=1).encode() + SEP + blobs[0] + SEP + blobs[1] +
        SEP + subs[0] + SEP + subs[1])
    bad_sub = subs[1].replace(b'"rank-00001.safetensors"', b'"/etc/passwd"')
    files3 = dict(files2)
    files3["rank-00001.slices.json"] = {"bytes": len(bad_sub), "crc32": zlib.crc32(bad_sub)}
    put("checkpoint", "escaping_slice_data", json.dumps(dict(index2, files=files3), indent=1).encode() + SEP + blobs[0] +
        SEP + blobs[1] + SEP + subs[0] + SEP + bad_sub)


def table_seeds():
    """Parquet (two row groups, a null-free text column beside another column) and Arrow IPC (stream and
    file formats, two record batches), each file preceded by the byte that selects its format."""
    script = (
        "import sys, pyarrow as pa, pyarrow.parquet as pq, pyarrow.ipc as ipc\n"
        "t = pa.table({'text': ['alpha', 'b\u00e9ta', '', 'gamma delta'], 'id': [1, 2, 3, 4]})\n"
        "pq.write_table(t, sys.argv[1] + '/a.parquet', row_group_size=2)\n"
        "with ipc.new_stream(sys.argv[1] + '/s.arrow', t.schema) as w:\n"
        "    for b in t.to_batches(max_chunksize=2): w.write_batch(b)\n"
        "with ipc.new_file(sys.argv[1] + '/f.arrow', t.schema) as w:\n"
        "    for b in t.to_batches(max_chunksize=2): w.write_batch(b)\n")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(ROOT / ".venv/bin/python"), "-c", script, tmp], check=True, capture_output=True)
        put("table", "parquet_two_row_groups", b"\x00" + Path(tmp + "/a.parquet").read_bytes())
        put("table", "arrow_stream", b"\x01" + Path(tmp + "/s.arrow").read_bytes())
        put("table", "arrow_file", b"\x01" + Path(tmp + "/f.arrow").read_bytes())


def dcp_seeds():
    """A torch.distributed.checkpoint folder as torchtitan writes one: a model tensor, the flattened AdamW
    state and non-tensor values (train_state, lr_scheduler, a param group's settings)."""
    script = (
        "import sys, torch, torch.distributed.checkpoint as dcp\n"
        "w = torch.arange(6, dtype=torch.float32).reshape(2, 3)\n"
        "sd = {'layers.0.attention.wq.weight': w, 'norm.weight': torch.ones(3, dtype=torch.bfloat16),\n"
        "      'optimizer': {'state.norm.weight.step': torch.tensor(2.0), 'state.norm.weight.exp_avg': torch.zeros(3),\n"
        "                    'param_groups.norm.weight.lr': 1e-3, 'param_groups.norm.weight.betas': (0.9, 0.95)},\n"
        "      'lr_scheduler': {'last_epoch': 2}, 'train_state': {'step': 2, 'ntokens_seen': 64}}\n"
        "dcp.save(sd, checkpoint_id=sys.argv[1], no_dist=True)\n")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([str(ROOT / ".venv/bin/python"), "-c", script, tmp + "/step-2"], check=True,
                       capture_output=True)
        metadata = Path(tmp + "/step-2/.metadata").read_bytes()
        data = Path(tmp + "/step-2/__0_0.distcp").read_bytes()
    put("dcp", "torchtitan_like", metadata + SEP + data)


if __name__ == "__main__":
    shutil.rmtree(OUT, ignore_errors=True)
    config_seeds()
    tokenizer_seeds()
    data_seeds()
    checkpoint_seeds()
    table_seeds()
    dcp_seeds()
    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"seed corpus: {sum(1 for p in OUT.rglob('*') if p.is_file())} files, {total // 1024} KiB in {OUT}")
