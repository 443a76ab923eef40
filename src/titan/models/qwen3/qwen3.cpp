#include "titan/models/qwen3/qwen3.h"

#include "titan/models/common/decoder_spec.h"

namespace titan::qwen3 {
namespace {
DecoderArgs make(int64_t dim, int64_t n_layers, int64_t n_heads, int64_t n_kv_heads, int64_t vocab,
                 int64_t hidden_dim, bool tied) {
  DecoderArgs a;
  a.dim = dim;
  a.n_layers = n_layers;
  a.n_heads = n_heads;
  a.n_kv_heads = n_kv_heads;
  a.attention_head_dim = 128;
  a.vocab_size = vocab;
  a.hidden_dim = hidden_dim;
  a.norm_eps = 1e-6;
  a.rope_theta = 1e6;
  a.rope_scaling.reset();
  a.max_seq_len = 40960;  // the released models' max_position_embeddings
  a.tie_embeddings = tied;
  a.qk_norm = true;
  return a;
}
// Qwen3-MoE: every layer's feed-forward is a mixture of `experts` SwiGLU experts of hidden size
// `expert_hidden`, 8 per token, softmax scores renormalized over the 8, no shared expert; `hidden_dim`
// is the dense size the released configs also list (intermediate_size), used by no layer.
DecoderArgs make_moe(int64_t dim, int64_t n_layers, int64_t n_heads, int64_t n_kv_heads, int64_t vocab,
                     int64_t hidden_dim, int64_t experts, int64_t expert_hidden, double theta) {
  DecoderArgs a = make(dim, n_layers, n_heads, n_kv_heads, vocab, hidden_dim, false);
  a.rope_theta = theta;
  DecoderMoE m;
  m.num_experts = experts;
  m.top_k = 8;
  m.hidden_dim = expert_hidden;
  m.route_norm = true;
  a.moe = m;
  return a;
}
}  // namespace

const FlavorTable& flavors() {
  static const FlavorTable table = {
      //                         dim  layers heads kv  vocab   hidden  tied
      {"debugmodel", make(256, 8, 16, 8, 2048, 3072, true)},
      {"0.6B", make(1024, 28, 16, 8, 151936, 3072, true)},
      {"1.7B", make(2048, 28, 16, 8, 151936, 6144, true)},
      {"4B", make(2560, 36, 32, 8, 151936, 9728, true)},
      {"8B", make(4096, 36, 32, 8, 151936, 12288, false)},
      {"14B", make(5120, 40, 40, 8, 151936, 17408, false)},
      {"32B", make(5120, 64, 64, 8, 151936, 25600, false)},
      //                                 dim  layers heads kv  vocab   hidden experts F    theta
      {"debugmodel_moe", make_moe(256, 8, 16, 8, 2048, 3072, 64, 768, 1e6)},
      {"30B-A3B", make_moe(2048, 48, 32, 4, 151936, 6144, 128, 768, 1e6)},
      {"235B-A22B", make_moe(4096, 94, 64, 4, 151936, 12288, 128, 1536, 5e6)},
  };
  return table;
}

DecoderArgs flavor(const std::string& name) { return table_flavor("qwen3", flavors(), name); }

ModelSpec spec() {
  return decoder_model_spec({"qwen3", &flavors(), HFDialect{"Qwen3ForCausalLM", "qwen3", true, 128, 32, "Qwen3MoeForCausalLM", "qwen3_moe", 0, 4}});
}

}  // namespace titan::qwen3
