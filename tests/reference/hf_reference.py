"""Hugging Face transformers side of titan's HF interop tests (tests/unit/checkpoint/hf_test.cpp).

  hf_reference.py load MODEL_DIR IN.safetensors OUT.safetensors
      Loads MODEL_DIR with AutoModelForCausalLM.from_pretrained (the architecture its config.json
      names: LlamaForCausalLM, Qwen3ForCausalLM; fp32, eager attention) and writes the logits of IN's
      "tokens" (B, S). Weights stored in bf16/fp16 are upcast exactly.
  hf_reference.py create CONFIG.json MODEL_DIR IN.safetensors OUT.safetensors [--seed N]
      Creates a randomly initialized model from the config arguments in CONFIG.json (its model_type,
      default "llama"; RMSNorm weights and DeepSeek-V3's routing biases randomized too, so that one
      mapped to the wrong place shows), saves it to MODEL_DIR with save_pretrained, then loads it
      back as `load` does.
  hf_reference.py grads MODEL_DIR IN.safetensors OUT.safetensors
      As `load`, and also the mean cross-entropy "loss" of the logits for IN's "labels" (B, S) and
      "grad.<name>" for every parameter (transformers' names) of that loss.

OUT holds "logits" (B, S, V) as float32 and a metadata entry "report": JSON with what loading said:
missing_keys, unexpected_keys, mismatched_keys, error_msgs (from output_loading_info), warnings
(every Python warning and transformers log record of level WARNING or above), config_dtype (the
dtype transformers reads from config.json, e.g. "bfloat16") and transformers_version. The C++ test decides what is acceptable.
"""

import argparse
import json
import logging
import warnings

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM


class Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


def load(model_dir, tokens):
    records = Records()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(records)
    transformers.logging.set_verbosity_warning()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, info = AutoModelForCausalLM.from_pretrained(
            model_dir, output_loading_info=True, attn_implementation="eager", dtype=torch.float32)
        config = AutoConfig.from_pretrained(model_dir)
    hf_logger.removeHandler(records)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    return logits, report_of(info, config, caught, records)


def report_of(info, config, caught, records):
    report = {
        "missing_keys": sorted(info.get("missing_keys", [])),
        "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": [str(k) for k in info.get("mismatched_keys", [])],
        "error_msgs": [str(m) for m in info.get("error_msgs", [])],
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught] + records.messages,
        "config_dtype": str(getattr(config, "dtype", None) or config.torch_dtype).replace("torch.", ""),
        "transformers_version": transformers.__version__,
    }
    return report


def create(config_path, model_dir, seed):
    with open(config_path) as f:
        kwargs = json.load(f)
    torch.manual_seed(seed)
    model_type = kwargs.pop("model_type", "llama")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kwargs)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):  # attention_bias / mlp_bias, zeros when created
                p.copy_(0.1 * torch.randn_like(p))
        # DeepSeek-V3's routing bias (a buffer, zero when created): random, so that one mapped to
        # the wrong place, or dropped, changes the experts chosen.
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(model_dir)


def grads(model_dir, tokens, labels):
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    model.train()
    logits = model(input_ids=tokens).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    out = {"logits": logits.detach().contiguous(), "loss": loss.detach().reshape(())}
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.contiguous()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["load", "create", "grads"])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.command == "create":
        config_path, model_dir, inp, out = args.paths
        create(config_path, model_dir, args.seed)
    else:
        model_dir, inp, out = args.paths
    torch.set_num_threads(2)
    batch = load_file(inp)
    if args.command == "grads":
        save_file(grads(model_dir, batch["tokens"], batch["labels"]), out)
        return
    logits, report = load(model_dir, batch["tokens"])
    save_file({"logits": logits.contiguous()}, out, metadata={"report": json.dumps(report)})


if __name__ == "__main__":
    main()
