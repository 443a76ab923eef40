#include "titan/models/deepseek_v3/deepseek_v3.h"

#include "titan/models/common/decoder_spec.h"

namespace titan::deepseek_v3 {
namespace {

struct Routing {
  int64_t experts, shared, top_k, groups, kept_groups;
  const char* score_func;
  bool route_norm;
  double route_scale;
};

// torchtitan's DeepSeek-V3 arguments: MLA with kv_lora_rank 512 and heads of 128 + 64 (RoPE) for q
// and k and 128 for v; YaRN over the 64 rotary dims (factor 40 from a 4,096-token original context,
// beta 32 / 1); RoPE theta 1e4; norm epsilon 1e-5; sequences up to 16,384 tokens; untied embeddings.
DecoderArgs make(int64_t dim, int64_t hidden, int64_t expert_hidden, int64_t n_layers, int64_t n_dense, int64_t n_heads,
                 int64_t vocab, int64_t q_lora_rank, double mscale, const Routing& r) {
  DecoderArgs a;
  a.dim = dim;
  a.n_layers = n_layers;
  a.n_heads = n_heads;
  a.vocab_size = vocab;
  a.hidden_dim = hidden;
  a.norm_eps = 1e-5;
  a.rope_theta = 10000.0;
  a.rope_scaling.reset();
  a.max_seq_len = 16384;
  DecoderMLA m;
  m.q_lora_rank = q_lora_rank;
  a.mla = m;
  YarnRope y;
  y.mscale = mscale;
  a.yarn = y;
  DecoderMoE e;
  e.num_experts = r.experts;
  e.num_shared_experts = r.shared;
  e.top_k = r.top_k;
  e.hidden_dim = expert_hidden;
  e.n_groups = r.groups;
  e.topk_groups = r.kept_groups;
  e.score_func = r.score_func;
  e.route_norm = r.route_norm;
  e.route_scale = r.route_scale;
  e.n_dense_layers = n_dense;
  a.moe = e;
  return a;
}

}  // namespace

const FlavorTable& flavors() {
  static const FlavorTable table = {
      //                         dim   hidden expert layers dense heads vocab  q_lora mscale
      {"debugmodel", make(256, 1024, 256, 6, 1, 16, 2048, 0, 0.70, {8, 2, 3, 0, 0, "softmax", false, 1.0})},
      {"16B", make(2048, 10944, 1408, 27, 1, 16, 102400, 0, 0.70, {64, 2, 6, 0, 0, "softmax", false, 1.0})},
      {"236B", make(5120, 12288, 1536, 60, 1, 128, 102400, 1536, 1.0, {160, 2, 6, 8, 3, "softmax", false, 16.0})},
      {"671B", make(7168, 18432, 2048, 61, 3, 128, 129280, 1536, 1.0, {256, 1, 8, 8, 4, "sigmoid", true, 2.5})},
  };
  return table;
}

DecoderArgs flavor(const std::string& name) { return table_flavor("deepseek_v3", flavors(), name); }

ModelSpec spec() {
  HFDialect hf;
  hf.architecture = "DeepseekV3ForCausalLM";
  hf.model_type = "deepseek_v3";
  hf.deepseek = true;
  return decoder_model_spec({"deepseek_v3", &flavors(), hf});
}

}  // namespace titan::deepseek_v3
