#include "titan/models/llama3/args.h"

#include "titan/models/common/decoder_spec.h"

namespace titan::llama3 {
namespace {
DecoderArgs make(int64_t dim, int64_t n_layers, int64_t n_heads, int64_t n_kv_heads, int64_t vocab,
                 int64_t multiple_of, std::optional<double> ffn_mult, bool tied) {
  DecoderArgs a;
  a.dim = dim;
  a.n_layers = n_layers;
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  a.vocab_size = vocab;
  a.multiple_of = multiple_of;
  a.ffn_dim_multiplier = ffn_mult;
  a.tie_embeddings = tied;
  a.norm_eps = 1e-5;
  a.rope_theta = 500000.0;
  a.rope_scaling = RopeScaling{};
  return a;
}
}  // namespace

const FlavorTable& flavors() {
  static const FlavorTable table = {
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

ModelArgs flavor(const std::string& name) { return table_flavor("llama3", flavors(), name); }

}  // namespace titan::llama3
