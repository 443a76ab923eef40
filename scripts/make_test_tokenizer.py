#!/usr/bin/env python3
"""Builds the small test tokenizers in assets/tokenizer/ (see assets/tokenizer/README.md).

  tokenizer.json      byte-level BPE (Hugging Face `tokenizers`), Llama 3 pre-tokenizer, 2048 ids:
                      <|begin_of_text|> = 0, <|end_of_text|> = 1, 256 byte tokens, 1790 merges.
                      A TemplateProcessing post-processor prepends <|begin_of_text|>, as Llama 3's does.
  tiktoken.model      Llama 3 tiktoken format ("base64(token bytes) rank" per line): the first 1792
                      tokens of tokenizer.json in merge order, so that with Llama 3's 256 special tokens
                      the tokenizer has 2048 ids.
  sentencepiece.model SentencePiece BPE, 2048 pieces, byte fallback (as Llama 2's).

The training text is generated deterministically from the docstrings of CPython's standard library
(PSF License 2.0) of the running interpreter. Usage: .venv/bin/python scripts/make_test_tokenizer.py
"""
import base64
import warnings
import importlib
import inspect
import io
import json
import os
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "assets", "tokenizer")

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
VOCAB_SIZE = 2048
TIKTOKEN_BASE = 2048 - 256  # Llama 3 adds 256 special tokens after the base vocabulary

# Standard-library modules whose docstrings make the corpus (sorted, fixed: the corpus is reproducible
# for a given Python version).
MODULES = sorted([
    "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib",
    "csv", "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools",
    "gzip", "hashlib", "heapq", "html", "http.client", "inspect", "io", "itertools", "json", "logging",
    "math", "os", "pathlib", "pickle", "random", "re", "shutil", "socket", "sqlite3", "statistics",
    "string", "subprocess", "tarfile", "textwrap", "threading", "typing", "unittest", "urllib.parse",
    "uuid", "zipfile",
])


def corpus() -> list[str]:
    """Docstrings of the modules above and their public classes, functions and methods."""
    docs = []

    def add(obj) -> None:
        doc = getattr(obj, "__doc__", None)
        if isinstance(doc, str) and doc.strip():
            docs.append(inspect.cleandoc(doc))

    for name in MODULES:
        mod = importlib.import_module(name)
        add(mod)
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            add(obj)
            if inspect.isclass(obj):
                for meth in sorted(vars(obj)):
                    member = vars(obj)[meth]
                    if not meth.startswith("_") and inspect.isroutine(member):
                        add(member)
    return sorted(set(docs))


def train_hf(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)])
    return tok


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, as character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = b
        else:
            chars[b] = 256 + n
            n += 1
    return {chr(c): b for b, c in chars.items()}


def write_tiktoken(tok: Tokenizer, path: str) -> None:
    """Token bytes in id order (bytes first, then merges), ranks 0..TIKTOKEN_BASE-1."""
    to_byte = byte_level_decoder()
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    specials = {BOS, EOS}
    ordered = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in specials]
    with open(path, "w") as f:
        for rank, token in enumerate(ordered[:TIKTOKEN_BASE]):
            raw = bytes(to_byte[c] for c in token)
            f.write(f"{base64.b64encode(raw).decode()} {rank}\n")


def write_sentencepiece(texts: list[str], path_prefix: str) -> None:
    import sentencepiece as spm
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([line for t in texts for line in t.splitlines() if line.strip()]),
        model_prefix=path_prefix, model_type="bpe", vocab_size=VOCAB_SIZE, byte_fallback=True,
        character_coverage=1.0, num_threads=1, minloglevel=2, bos_id=1, eos_id=2, unk_id=0)
    os.remove(path_prefix + ".vocab")


def main() -> None:
    warnings.simplefilter("ignore", DeprecationWarning)  # typing.io / typing.re docstrings
    texts = corpus()
    print(f"corpus: {len(texts)} docstrings, {sum(len(t) for t in texts)} characters "
          f"(Python {sys.version.split()[0]})")
    os.makedirs(OUT, exist_ok=True)
    tok = train_hf(texts)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    tok.save(os.path.join(OUT, "tokenizer.json"))
    write_tiktoken(tok, os.path.join(OUT, "tiktoken.model"))
    write_sentencepiece(texts, os.path.join(OUT, "sentencepiece"))
    for name in ("tokenizer.json", "tiktoken.model", "sentencepiece.model"):
        print(f"{name}: {os.path.getsize(os.path.join(OUT, name))} bytes")


if __name__ == "__main__":
    main()
