"""Hugging Face side of titan's export-with-tokenizer test (tests/unit/checkpoint/hf_test.cpp).

  hf_tokenizer_reference.py MODEL_DIR TEXT_FILE OUT.json

Loads MODEL_DIR whole, as a user would: AutoTokenizer.from_pretrained and
AutoModelForCausalLM.from_pretrained (and its GenerationConfig), then writes to OUT.json the
tokenizer's class, its BOS/EOS ids, the ids of TEXT_FILE's text (the tokenizer's own special tokens
added, as for a prompt), the decoded text, the model's class and the generation config's BOS/EOS.
"""

import json
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig


def main():
    model_dir, text_file, out_file = sys.argv[1:4]
    with open(text_file, encoding="utf-8") as f:
        text = f.read()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = GenerationConfig.from_pretrained(model_dir)
    out = {
        "tokenizer_class": type(tok).__name__,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "ids": ids,
        "decoded": tok.decode(ids, skip_special_tokens=True),
        "model_class": type(model).__name__,
        "generation_bos": gen.bos_token_id,
        "generation_eos": gen.eos_token_id,
    }
    with open(out_file, "w", encoding="utf-8") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
