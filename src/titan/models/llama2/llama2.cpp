#include "titan/models/llama2/llama2.h"

#include "titan/models/common/decoder_spec.h"

namespace titan::llama2 {
namespace {
DecoderArgs make(int64_t dim, int64_t n_layers, int64_t n_heads, int64_t n_kv_heads, int64_t vocab,
                 int64_t multiple_of, std::optional<double> ffn_mult) {
  DecoderArgs a;
  a.dim = dim;
  a.n_layers = n_layers;
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  a.vocab_size = vocab;
  a.multiple_of = multiple_of;
  a.ffn_dim_multiplier = ffn_mult;
  a.norm_eps = 1e-5;
  a.rope_theta = 10000.0;
  a.rope_scaling.reset();
  a.max_seq_len = 4096;
  a.tie_embeddings = false;
  return a;
}
}  // namespace

const FlavorTable& flavors() {
  static const FlavorTable table = {
      //                         dim  layers heads kv  vocab  multiple_of ffn_mult
      // The debug model: the test tokenizer's 2048 ids (assets/tokenizer/sentencepiece.model).
      {"debugmodel", make(256, 2, 16, 0, 2048, 256, std::nullopt)},
      {"7B", make(4096, 32, 32, 0, 32000, 256, std::nullopt)},
      {"13B", make(5120, 40, 40, 0, 32000, 256, std::nullopt)},
      {"70B", make(8192, 80, 64, 8, 32000, 4096, 1.3)},
  };
  return table;
}

DecoderArgs flavor(const std::string& name) { return table_flavor("llama2", flavors(), name); }

ModelSpec spec() {
  return decoder_model_spec({"llama2", &flavors(), HFDialect{"LlamaForCausalLM", "llama", false, 0}});
}

}  // namespace titan::llama2
