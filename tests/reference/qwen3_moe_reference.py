"""transformers' Qwen3MoeForCausalLM side of titan's MoE decoder test (tests/unit/models/moe_decoder_test.cpp).

  qwen3_moe_reference.py CONFIG.json WEIGHTS.safetensors BATCH.safetensors OUT.safetensors

Builds Qwen3MoeForCausalLM from CONFIG.json (fp32, eager attention), loads titan's weights into it
(WEIGHTS in titan's names and layouts: q/k projection rows and QK-norm weights in Meta's interleaved
RoPE order, experts stacked as w1, w3 (E, F, D) and w2 (E, D, F)), and writes for BATCH's "tokens"
and "labels" (B, S): "logits", the mean cross-entropy "loss", "grad.<titan name>" of every parameter
mapped back to titan's names and layouts, and "counts.<layer>": how many routed token copies each
expert received in that layer (transformers' router's top-k).
"""

import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from moe_transformers import forward_backward, fused_expert_grads

# transformers 5 holds the experts fused (mlp.experts.gate_up_proj (E, 2F, D), down_proj (E, D, F))
# and its router returns (logits, weights, indices); 4.x had one module per expert.
if int(transformers.__version__.split(".")[0]) < 5:
    sys.exit(f"qwen3_moe_reference.py needs transformers 5 or newer, found {transformers.__version__}")


def interleaved_to_halves(w, heads):
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def halves_to_interleaved(w, heads):
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(w.shape)


def main():
    config_path, weights_path, batch_path, out_path = sys.argv[1:]
    torch.set_num_threads(2)
    config = AutoConfig.from_pretrained(config_path)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).float()
    titan = load_file(weights_path)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    # titan name -> (HF name, to HF, back to titan)
    plain = (lambda t: t, lambda t: t)
    rows_q = (lambda t: interleaved_to_halves(t, heads), lambda t: halves_to_interleaved(t, heads))
    rows_k = (lambda t: interleaved_to_halves(t, kv_heads), lambda t: halves_to_interleaved(t, kv_heads))
    vec = (lambda t: interleaved_to_halves(t.reshape(-1, 1), 1).reshape(-1),
           lambda t: halves_to_interleaved(t.reshape(-1, 1), 1).reshape(-1))
    mapping = {"tok_embeddings.weight": ("model.embed_tokens.weight", plain),
               "norm.weight": ("model.norm.weight", plain),
               "output.weight": ("lm_head.weight", plain)}
    moe_layers = []
    for i in range(config.num_hidden_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        mapping.update({
            t + "attention.wq.weight": (h + "self_attn.q_proj.weight", rows_q),
            t + "attention.wk.weight": (h + "self_attn.k_proj.weight", rows_k),
            t + "attention.wv.weight": (h + "self_attn.v_proj.weight", plain),
            t + "attention.wo.weight": (h + "self_attn.o_proj.weight", plain),
            t + "attention.q_norm.weight": (h + "self_attn.q_norm.weight", vec),
            t + "attention.k_norm.weight": (h + "self_attn.k_norm.weight", vec),
            t + "attention_norm.weight": (h + "input_layernorm.weight", plain),
            t + "ffn_norm.weight": (h + "post_attention_layernorm.weight", plain),
        })
        if t + "feed_forward.w1.weight" in titan:  # a dense layer (mlp_only_layers)
            mapping.update({
                t + "feed_forward.w1.weight": (h + "mlp.gate_proj.weight", plain),
                t + "feed_forward.w3.weight": (h + "mlp.up_proj.weight", plain),
                t + "feed_forward.w2.weight": (h + "mlp.down_proj.weight", plain),
            })
        else:
            moe_layers.append(i)
            mapping.update({
                t + "moe.router.gate.weight": (h + "mlp.gate.weight", plain),
                t + "moe.experts.w2": (h + "mlp.experts.down_proj", plain),
            })
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, (hf, (to_hf, _)) in mapping.items():
            params[hf].copy_(to_hf(titan[name]))
        for i in moe_layers:
            t = f"layers.{i}.moe.experts."
            params[f"model.layers.{i}.mlp.experts.gate_up_proj"].copy_(torch.cat([titan[t + "w1"], titan[t + "w3"]], 1))
    assert len(mapping) + 2 * len(moe_layers) == len(titan), sorted(set(titan) - set(mapping))

    out = forward_backward(model, moe_layers, config.num_experts, batch_path)
    for name, (hf, (_, back)) in mapping.items():
        out["grad." + name] = back(params[hf].grad).contiguous()
    out.update(fused_expert_grads(params, moe_layers))
    save_file(out, out_path)


if __name__ == "__main__":
    main()
