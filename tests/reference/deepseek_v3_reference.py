"""transformers' DeepseekV3ForCausalLM side of titan's DeepSeek-V3 decoder test.

  deepseek_v3_reference.py CONFIG_DIR WEIGHTS.safetensors BATCH.safetensors OUT.safetensors

Builds DeepseekV3ForCausalLM from CONFIG_DIR/config.json (fp32, eager attention), loads titan's weights
into it (WEIGHTS in titan's names and layouts: multi-head latent attention as wq or wq_a/q_norm/wq_b,
wkv_a, kv_norm, wkv_b, wo, with the RoPE rows in DeepSeek's interleaved-pair order, which is what
transformers reads with rope_interleave=True, so no row permutation; the first first_k_dense_replace
layers dense, the rest MoE with experts stacked as w1, w3 (E, F, D) and w2 (E, D, F), shared experts,
and the optional buffer moe.expert_bias, transformers' e_score_correction_bias), and writes for BATCH's
"tokens" and "labels" (B, S): "logits", the mean cross-entropy "loss", "grad.<titan name>" of every
parameter mapped back to titan's names and layouts, and "counts.<layer>": how many routed token copies
each expert received in that MoE layer (transformers' router's top-k).
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
    sys.exit(f"deepseek_v3_reference.py needs transformers 5 or newer, found {transformers.__version__}")


def main():
    config_dir, weights_path, batch_path, out_path = sys.argv[1:]
    torch.set_num_threads(2)
    config = AutoConfig.from_pretrained(config_dir)
    assert config.model_type == "deepseek_v3", config.model_type
    config._attn_implementation = "eager"
    # transformers builds the low-rank query path whenever q_lora_rank is not None; titan reads 0 as "none".
    if not config.q_lora_rank:
        config.q_lora_rank = None
    assert config.rope_interleave, "titan stores RoPE rows as interleaved pairs (rope_interleave=True)"
    model = AutoModelForCausalLM.from_config(config).float()
    titan = load_file(weights_path)

    # titan name -> HF name; every layout is the same on both sides except the fused experts below.
    mapping = {"tok_embeddings.weight": "model.embed_tokens.weight",
               "norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
    moe_layers = []
    for i in range(config.num_hidden_layers):
        t, h = f"layers.{i}.", f"model.layers.{i}."
        mapping.update({
            t + "attention_norm.weight": h + "input_layernorm.weight",
            t + "ffn_norm.weight": h + "post_attention_layernorm.weight",
            t + "attention.wkv_a.weight": h + "self_attn.kv_a_proj_with_mqa.weight",
            t + "attention.kv_norm.weight": h + "self_attn.kv_a_layernorm.weight",
            t + "attention.wkv_b.weight": h + "self_attn.kv_b_proj.weight",
            t + "attention.wo.weight": h + "self_attn.o_proj.weight",
        })
        if config.q_lora_rank is None:
            mapping[t + "attention.wq.weight"] = h + "self_attn.q_proj.weight"
        else:
            mapping.update({
                t + "attention.wq_a.weight": h + "self_attn.q_a_proj.weight",
                t + "attention.q_norm.weight": h + "self_attn.q_a_layernorm.weight",
                t + "attention.wq_b.weight": h + "self_attn.q_b_proj.weight",
            })
        if i < config.first_k_dense_replace:
            mapping.update({
                t + "feed_forward.w1.weight": h + "mlp.gate_proj.weight",
                t + "feed_forward.w3.weight": h + "mlp.up_proj.weight",
                t + "feed_forward.w2.weight": h + "mlp.down_proj.weight",
            })
        else:
            moe_layers.append(i)
            mapping.update({
                t + "moe.router.gate.weight": h + "mlp.gate.weight",
                t + "moe.experts.w2": h + "mlp.experts.down_proj",
                t + "moe.shared_experts.w1.weight": h + "mlp.shared_experts.gate_proj.weight",
                t + "moe.shared_experts.w3.weight": h + "mlp.shared_experts.up_proj.weight",
                t + "moe.shared_experts.w2.weight": h + "mlp.shared_experts.down_proj.weight",
            })
    params = dict(model.named_parameters())
    missing = sorted(name for name in mapping if name not in titan)
    assert not missing, f"titan weights missing from WEIGHTS: {missing}"
    used = set(mapping)
    set_params = set()
    with torch.no_grad():
        for name, hf in mapping.items():
            params[hf].copy_(titan[name])
            set_params.add(hf)
        for i in moe_layers:
            t, h = f"layers.{i}.moe.", f"model.layers.{i}.mlp."
            # gate_up_proj[e] rows: gate (w1) first, then up (w3); the experts take chunk(2, -1) of x @ it.T.
            params[h + "experts.gate_up_proj"].copy_(torch.cat([titan[t + "experts.w1"], titan[t + "experts.w3"]], 1))
            set_params.add(h + "experts.gate_up_proj")
            used.update([t + "experts.w1", t + "experts.w3"])
            if t + "expert_bias" in titan:  # a buffer, not a parameter: absent means zeros
                model.model.layers[i].mlp.gate.e_score_correction_bias.copy_(titan[t + "expert_bias"])
                used.add(t + "expert_bias")
    assert used == set(titan), sorted(set(titan) - used)
    assert set_params == set(params), sorted(set(params) - set_params)

    out = forward_backward(model, moe_layers, config.n_routed_experts, batch_path)
    for name, hf in mapping.items():
        out["grad." + name] = params[hf].grad.contiguous()
    out.update(fused_expert_grads(params, moe_layers))
    save_file(out, out_path)


if __name__ == "__main__":
    main()
