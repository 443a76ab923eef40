// Llama 3 model arguments and the flavors torchtitan defines (debugmodel, 1B, 3B, 8B, 70B, 405B).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace titan::llama3 {

// Llama 3.1 RoPE frequency scaling ("llama" scaling in torchtitan).
struct RopeScaling {
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct ModelArgs {
  int64_t dim = 4096;
  int64_t n_layers = 32;
  int64_t n_heads = 32;
  int64_t n_kv_heads = 0;  // 0: same as n_heads (plain multi-head attention)
  int64_t vocab_size = 128256;
  int64_t multiple_of = 256;                  // SwiGLU hidden size is rounded up to this
  std::optional<double> ffn_dim_multiplier;   // applied to int(8*dim/3) before rounding
  double norm_eps = 1e-5;
  double rope_theta = 500000.0;
  std::optional<RopeScaling> rope_scaling = RopeScaling{};
  int64_t max_seq_len = 131072;  // longest sequence RoPE is defined for
  bool tie_embeddings = false;   // output projection shares tok_embeddings.weight
  bool depth_init = true;        // output projections' init std shrinks with layer depth

  int64_t kv_heads() const { return n_kv_heads > 0 ? n_kv_heads : n_heads; }
  int64_t head_dim() const { return dim / n_heads; }
  // torchtitan's rule: hidden = multiple_of * ceil(int(ffn_mult * int(2 * 4 * dim / 3)) / multiple_of).
  int64_t ffn_hidden_dim() const;
  // Throws titan::UserError when the shape is inconsistent (heads not dividing dim, ...).
  void validate() const;
};

// Flavors by name, in torchtitan's order.
const std::vector<std::pair<std::string, ModelArgs>>& flavors();
// The named flavor, or a UserError listing the known ones.
ModelArgs flavor(const std::string& name);

}  // namespace titan::llama3
