// The arguments of titan's decoder-only transformer (models/common/decoder.h), which every dense
// family is built on: Llama 3, Llama 2 and Qwen3 differ only in these values (a family is a table
// of flavors plus its Hugging Face dialect, see decoder_spec.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace titan {
namespace nn {
struct MoEOptions;
}

// Llama 3.1 RoPE frequency scaling ("llama3" rope_type in transformers).
struct RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// The feed-forward of a decoder's MoE layers (nn/moe.h): routed SwiGLU experts, optional shared
// experts. Layers with an id below n_dense_layers keep the dense feed-forward (DeepSeek's first
// layers; 0: every layer is MoE, as in Qwen3-MoE).
struct DecoderMoE {
  int64_t num_experts = 0;             // E
  int64_t top_k = 1;                   // K experts per token
  int64_t hidden_dim = 0;              // F, each routed expert's SwiGLU hidden size
  int64_t num_shared_experts = 0;      // a shared SwiGLU of hidden F x this count on every token
  std::string score_func = "softmax";  // "softmax" | "sigmoid"
  bool route_norm = false;             // the K weights of a token normalized to sum 1
  double route_scale = 1.0;
  int64_t n_groups = 0;                // group-limited routing: groups, and groups kept per token
  int64_t topk_groups = 0;
  // torchtitan's auxiliary-loss-free balancing: each step every expert's routing bias moves by this
  // rate towards balance (the trainer updates it from the step's token counts); 0 disables it.
  double load_balance_coeff = 1e-3;
  // The auxiliary load-balancing loss's coefficient (nn/moe.h; 0: none, as in torchtitan's flavors;
  // model.moe_aux_loss_coeff overrides it).
  double aux_loss_coeff = 0;
  int64_t n_dense_layers = 0;
};

// Multi-head latent attention (DeepSeek-V2/V3, nn/mla.h) in place of grouped-query attention.
struct DecoderMLA {
  int64_t q_lora_rank = 0;  // 0: no query latent (wq projects directly)
  int64_t kv_lora_rank = 512;
  int64_t qk_nope_head_dim = 128;
  int64_t qk_rope_head_dim = 64;
  int64_t v_head_dim = 128;
};

// YaRN RoPE scaling (DeepSeek-V3; transformers' rope_type "yarn"), over MLA's rotary dims.
struct YarnRope {
  double factor = 40;
  int64_t original_seq_len = 4096;
  double beta_fast = 32, beta_slow = 1;
  double mscale = 1.0;
};

struct DecoderArgs {
  int64_t dim = 4096;
  int64_t n_layers = 32;
  int64_t n_heads = 32;
  int64_t n_kv_heads = 0;         // 0: same as n_heads (plain multi-head attention)
  int64_t attention_head_dim = 0;  // 0: dim / n_heads (Qwen3 sets 128 whatever dim is)
  int64_t vocab_size = 128256;
  // Feed-forward (SwiGLU) hidden size: `hidden_dim` when set (Qwen3's flavors and any Hugging Face
  // config name it), else torchtitan's Llama rule from multiple_of and ffn_dim_multiplier.
  int64_t hidden_dim = 0;
  int64_t multiple_of = 256;
  std::optional<double> ffn_dim_multiplier;
  double norm_eps = 1e-5;
  double rope_theta = 500000.0;
  std::optional<RopeScaling> rope_scaling = RopeScaling{};
  int64_t max_seq_len = 131072;  // longest sequence RoPE is defined for
  bool tie_embeddings = false;   // output projection shares tok_embeddings.weight
  bool qk_norm = false;          // per-head RMSNorm of q and k before RoPE (Qwen3)
  bool attention_bias = false;   // biases on wq, wk, wv and wo (transformers' attention_bias)
  bool mlp_bias = false;         // biases on the dense feed-forwards' w1, w2, w3 (transformers' mlp_bias)
  bool depth_init = true;        // output projections' init std shrinks with layer depth
  std::optional<DecoderMoE> moe;  // mixture-of-experts feed-forward (in layers from moe->n_dense_layers)
  std::optional<DecoderMLA> mla;  // multi-head latent attention (n_kv_heads and head_dim then unused)
  std::optional<YarnRope> yarn;   // with mla: YaRN scaling of its rotary dims (rope_scaling must be unset)

  int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  int64_t head_dim() const { return attention_head_dim > 0 ? attention_head_dim : dim / n_heads; }
  // The dims RoPE rotates per head: head_dim, or MLA's qk_rope_head_dim.
  int64_t rope_dim() const { return mla ? mla->qk_rope_head_dim : head_dim(); }
  // hidden_dim, or torchtitan's rule: multiple_of * ceil(int(ffn_mult * int(2 * 4 * dim / 3)) / multiple_of).
  int64_t ffn_hidden_dim() const;
  // Whether layer `id`'s feed-forward is the mixture of experts.
  bool is_moe_layer(int64_t id) const { return moe.has_value() && id >= moe->n_dense_layers; }
  // Throws titan::UserError when the shape is inconsistent (heads not dividing dim, ...).
  void validate() const;
};

// The nn::MoE options of the model's MoE layers (args.moe must be set).
nn::MoEOptions moe_options(const DecoderArgs& args);

// A flavor table: names in the family's order, with their arguments.
using FlavorTable = std::vector<std::pair<std::string, DecoderArgs>>;

}  // namespace titan
