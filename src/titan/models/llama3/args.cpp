#include "titan/models/llama3/args.h"

#include "titan/common/error.h"

namespace titan::llama3 {

int64_t ModelArgs::ffn_hidden_dim() const {
  // FeedForward is built with hidden_dim = 4 * dim and reduces it to 2/3 of that.
  int64_t hidden = static_cast<int64_t>(2.0 * static_cast<double>(4 * dim) / 3.0);
  if (ffn_dim_multiplier) hidden = static_cast<int64_t>(*ffn_dim_multiplier * static_cast<double>(hidden));
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

void ModelArgs::validate() const {
  TITAN_USER_CHECK(dim > 0 && n_layers > 0 && n_heads > 0 && vocab_size > 0 && multiple_of > 0,
                   "model: dim, n_layers, n_heads, vocab_size and multiple_of must be positive");
  TITAN_USER_CHECK(dim % n_heads == 0, "model: dim ", dim, " is not divisible by n_heads ", n_heads);
  TITAN_USER_CHECK(n_heads % kv_heads() == 0, "model: n_heads ", n_heads,
                   " is not a multiple of n_kv_heads ", kv_heads());
  TITAN_USER_CHECK(head_dim() % 2 == 0, "model: head_dim ", head_dim(), " must be even for RoPE");
}

namespace {
ModelArgs make(int64_t dim, int64_t n_layers, int64_t n_heads, int64_t n_kv_heads, int64_t vocab,
               int64_t multiple_of, std::optional<double> ffn_mult, bool tied) {
  ModelArgs a;
  a.dim = dim;
  a.n_layers = n_layers;
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  a.vocab_size = vocab;
  a.multiple_of = multiple_of;
  a.ffn_dim_multiplier = ffn_mult;
  a.tie_embeddings = tied;
  return a;
}
}  // namespace

const std::vector<std::pair<std::string, ModelArgs>>& flavors() {
  static const std::vector<std::pair<std::string, ModelArgs>> table = {
      //                         dim  layers heads kv  vocab   multiple_of ffn_mult  tied
      {"debugmodel", make(256, 6, 16, 0, 2048, 256, std::nullopt, false)},
      {"1B", make(2048, 16, 32, 8, 128256, 1024, 1.5, true)},
      {"3B", make(3072, 28, 24, 8, 128256, 1024, 1.0, true)},
      {"8B", make(4096, 32, 32, 8, 128256, 1024, 1.3, false)},
      {"70B", make(8192, 80, 64, 8, 128256, 4096, 1.3, false)},
      {"405B", make(16384, 126, 128, 8, 128256, 4096, 1.2, false)},
  };
  return table;
}

ModelArgs flavor(const std::string& name) {
  std::string known;
  for (const auto& [n, args] : flavors()) {
    if (n == name) return args;
    known += (known.empty() ? "" : ", ") + n;
  }
  throw UserError("model.flavor '" + name + "' is not a llama3 flavor; choose one of: " + known);
}

}  // namespace titan::llama3
