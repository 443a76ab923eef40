// The decoder (decoder.h) <-> Hugging Face transformers: state-dict conversion and config.json,
// for each architecture a family maps to (LlamaForCausalLM for Llama 2 and 3, Qwen3ForCausalLM).
//
// Names map one to one (tok_embeddings -> model.embed_tokens, attention.wq -> self_attn.q_proj,
// attention.q_norm -> self_attn.q_norm, feed_forward.w1/w3/w2 -> mlp.gate_proj/up_proj/down_proj,
// ...). wq and wk rows, and the QK-norm weights, are permuted between Meta's interleaved RoPE pairs
// (titan's) and HF's rotate-half layout. With tied embeddings HF stores no lm_head.weight.
#pragma once

#include "titan/models/common/decoder_args.h"
#include "titan/models/registry.h"

#include <string>

namespace titan {

// What distinguishes an architecture's config.json and weights.
struct HFDialect {
  std::string architecture;      // "LlamaForCausalLM"
  std::string model_type;        // "llama"
  bool qk_norm = false;          // the architecture normalizes q and k per head (every layer)
  int64_t default_head_dim = 0;  // head_dim when config.json gives none; 0: hidden_size / num_attention_heads
  int64_t default_kv_heads = 0;  // num_key_value_heads when absent; 0: num_attention_heads (null always means that)
  // The architecture's mixture-of-experts variant ("Qwen3MoeForCausalLM", "qwen3_moe"); empty: none.
  std::string moe_architecture;
  std::string moe_model_type;
  int64_t moe_default_head_dim = 0;  // as default_head_dim, for the MoE variant's config class
  int64_t moe_default_kv_heads = 0;  // as default_kv_heads, for the MoE variant's config class
  // DeepSeek-V3's config.json and names: multi-head latent attention (self_attn.q_proj or q_a_proj,
  // q_a_layernorm, q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj; o_proj), every layer
  // from first_k_dense_replace a mixture of experts with shared experts (mlp.shared_experts.*) and
  // its routing bias as mlp.gate.e_score_correction_bias; RoPE pairs stored interleaved, as titan's.
  bool deepseek = false;
};

HFAdapter decoder_hf_adapter(const DecoderArgs& args, const HFDialect& dialect);

// The arguments a transformers config.json of `dialect` describes (sizes, heads, head_dim, RoPE
// theta and scaling, tied embeddings, norm epsilon, max_position_embeddings as max_seq_len). The
// sizes (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, vocab_size) must be
// given; other absent fields take the config class's defaults. Throws UserError naming the first
// field titan cannot honour (another model_type, biases, dropout, a RoPE type other than default
// and llama3, sliding-window attention, a missing or malformed size). The dialect's MoE model_type
// (qwen3_moe) gives MoE layers: num_experts, num_experts_per_tok, moe_intermediate_size,
// norm_topk_prob, and mlp_only_layers as the first dense layers (decoder_sparse_step must be 1).
DecoderArgs decoder_args_from_hf_config(const std::string& text, const HFDialect& dialect);

}  // namespace titan
