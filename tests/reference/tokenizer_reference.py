#!/usr/bin/env python3
"""Reference tokenization with the Python packages, for titan's tokenizer parity tests.

  tokenizer_reference.py encode <request.json> <response.json>
      request:  {"kind": "hf" | "tiktoken" | "sentencepiece", "path": ..., "texts": [...]}
      response: {"ids": [[...]], "ids_with_specials": [[...]], "decoded": [...], "vocab_size": n,
                 "bos": id | null, "eos": id | null}
      hf: `tokenizers` (encode without / with the post-processor, decode keeping special tokens);
      tiktoken: `tiktoken` with Llama 3's pattern and special tokens, allowed_special="all";
      sentencepiece: `sentencepiece`.
  tokenizer_reference.py pretokenize <request.json> <response.json>
      request: {"path": tokenizer.json, "texts": [...]}; response: {"pieces": [[...]]}, the pieces of
      the file's pre-tokenizer (pre_tokenize_str), as raw UTF-8 strings (ByteLevel mapping undone).
  tokenizer_reference.py variants <tokenizer.json> <out_dir>
      Writes variants of a byte-level BPE tokenizer.json that exercise other supported features, each
      checked to load in `tokenizers`: merges_as_strings.json, gpt2_style.json (ByteLevel with its own
      regex and add_prefix_space, no ignore_merges), added_tokens.json (extra special and non-special
      added tokens).
"""
import copy
import json
import os
import sys

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def llama3_specials() -> list[str]:
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    return named + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]


def encode_hf(path, texts):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(path)
    out = {"ids": [], "ids_with_specials": [], "decoded": []}
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False).ids
        out["ids"].append(ids)
        out["ids_with_specials"].append(tok.encode(t, add_special_tokens=True).ids)
        out["decoded"].append(tok.decode(ids, skip_special_tokens=False))
    out["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
    out["bos"] = tok.token_to_id("<|begin_of_text|>")
    out["eos"] = tok.token_to_id("<|end_of_text|>")
    return out


def encode_tiktoken(path, texts):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(path)
    specials = {s: len(ranks) + i for i, s in enumerate(llama3_specials())}
    enc = tiktoken.Encoding(name="test", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    out = {"ids": [], "ids_with_specials": [], "decoded": []}
    for t in texts:
        ids = enc.encode(t, allowed_special="all")
        out["ids"].append(ids)
        out["ids_with_specials"].append([specials["<|begin_of_text|>"]] + ids + [specials["<|end_of_text|>"]])
        out["decoded"].append(enc.decode(ids))
    out["vocab_size"] = enc.n_vocab
    out["bos"], out["eos"] = specials["<|begin_of_text|>"], specials["<|end_of_text|>"]
    return out


def encode_sentencepiece(path, texts):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=path)
    out = {"ids": [], "ids_with_specials": [], "decoded": []}
    for t in texts:
        ids = sp.encode(t)
        out["ids"].append(ids)
        out["ids_with_specials"].append(sp.encode(t, add_bos=True, add_eos=True))
        out["decoded"].append(sp.decode(ids))
    out["vocab_size"] = sp.get_piece_size()
    out["bos"] = sp.bos_id() if sp.bos_id() >= 0 else None
    out["eos"] = sp.eos_id() if sp.eos_id() >= 0 else None
    return out


def pretokenize(path, texts):
    from tokenizers import Tokenizer, decoders
    tok = Tokenizer.from_file(path)
    dec = decoders.ByteLevel()
    return {"pieces": [[dec.decode([p]) for p, _ in tok.pre_tokenizer.pre_tokenize_str(t)] for t in texts]}


def variants(path, out_dir):
    from tokenizers import AddedToken, Tokenizer
    with open(path) as f:
        base = json.load(f)

    def save(name, data):
        p = os.path.join(out_dir, name)
        with open(p, "w") as f:
            json.dump(data, f, ensure_ascii=False)
        Tokenizer.from_file(p)  # must load in the reference too

    v = copy.deepcopy(base)
    v["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in v["model"]["merges"]]
    save("merges_as_strings.json", v)

    v = copy.deepcopy(base)
    v["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    v["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    v["model"]["ignore_merges"] = False
    save("gpt2_style.json", v)

    tok = Tokenizer.from_str(json.dumps(base))
    tok.add_special_tokens([AddedToken("<|eot_id|>", special=True, normalized=False)])
    tok.add_tokens([AddedToken("hello world", special=False, normalized=False),
                    AddedToken("<|end", special=False, normalized=False)])
    p = os.path.join(out_dir, "added_tokens.json")
    tok.save(p)


def main():
    if sys.argv[1] == "variants":
        variants(sys.argv[2], sys.argv[3])
        return
    with open(sys.argv[2]) as f:
        req = json.load(f)
    if sys.argv[1] == "pretokenize":
        out = pretokenize(req["path"], req["texts"])
        with open(sys.argv[3], "w") as f:
            json.dump(out, f)
        return
    fn = {"hf": encode_hf, "tiktoken": encode_tiktoken, "sentencepiece": encode_sentencepiece}[req["kind"]]
    out = fn(req["path"], req["texts"])
    with open(sys.argv[3], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
