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

// Llama 3.1 RoPE frequency scaling ("llama3" rope_type in transformers).
struct RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
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
  bool depth_init = true;        // output projections' init std shrinks with layer depth

  int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  int64_t head_dim() const { return attention_head_dim > 0 ? attention_head_dim : dim / n_heads; }
  // hidden_dim, or torchtitan's rule: multiple_of * ceil(int(ffn_mult * int(2 * 4 * dim / 3)) / multiple_of).
  int64_t ffn_hidden_dim() const;
  // Throws titan::UserError when the shape is inconsistent (heads not dividing dim, ...).
  void validate() const;
};

// A flavor table: names in the family's order, with their arguments.
using FlavorTable = std::vector<std::pair<std::string, DecoderArgs>>;

}  // namespace titan
