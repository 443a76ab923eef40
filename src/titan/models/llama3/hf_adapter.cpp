#include "titan/models/llama3/hf_adapter.h"

#include "titan/common/error.h"

#include <ATen/ATen.h>

#include <regex>

namespace titan::llama3 {
namespace {

// Per-layer suffixes: titan name -> HF name.
const std::vector<std::pair<std::string, std::string>>& layer_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"attention.wq.weight", "self_attn.q_proj.weight"},
      {"attention.wk.weight", "self_attn.k_proj.weight"},
      {"attention.wv.weight", "self_attn.v_proj.weight"},
      {"attention.wo.weight", "self_attn.o_proj.weight"},
      {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
      {"feed_forward.w2.weight", "mlp.down_proj.weight"},
      {"feed_forward.w3.weight", "mlp.up_proj.weight"},
      {"attention_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
  };
  return names;
}

// Rows of a q/k projection (heads*E, D): within each head, Meta orders rotation pairs
// interleaved (r0 i0 r1 i1 ...), HF as halves (r0 r1 ... i0 i1 ...).
at::Tensor interleaved_to_halves(const at::Tensor& w, int64_t heads) {
  const auto rows = w.size(0), cols = w.size(1);
  return w.view({heads, rows / heads / 2, 2, cols}).transpose(1, 2).reshape({rows, cols});
}
at::Tensor halves_to_interleaved(const at::Tensor& w, int64_t heads) {
  const auto rows = w.size(0), cols = w.size(1);
  return w.view({heads, 2, rows / heads / 2, cols}).transpose(1, 2).reshape({rows, cols});
}

StateDict convert(const StateDict& in, const ModelArgs& args, bool to_hf) {
  static const std::regex titan_layer(R"(^layers\.(\d+)\.(.+)$)");
  static const std::regex hf_layer(R"(^model\.layers\.(\d+)\.(.+)$)");
  const std::vector<std::pair<std::string, std::string>> globals = {
      {"tok_embeddings.weight", "model.embed_tokens.weight"},
      {"norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
  };
  StateDict out;
  for (const auto& [name, tensor] : in) {
    std::string mapped;
    for (const auto& [t, h] : globals)
      if (name == (to_hf ? t : h)) mapped = to_hf ? h : t;
    if (args.tie_embeddings && mapped == (to_hf ? "lm_head.weight" : "output.weight")) continue;
    at::Tensor value = tensor;
    std::smatch m;
    if (mapped.empty() && std::regex_match(name, m, to_hf ? titan_layer : hf_layer)) {
      const std::string layer = m[1], suffix = m[2];
      for (const auto& [t, h] : layer_names()) {
        if (suffix != (to_hf ? t : h)) continue;
        mapped = to_hf ? "model.layers." + layer + "." + h : "layers." + layer + "." + t;
        const int64_t heads = t == "attention.wq.weight" ? args.n_heads
                              : t == "attention.wk.weight" ? args.kv_heads() : 0;
        if (heads) value = to_hf ? interleaved_to_halves(tensor, heads) : halves_to_interleaved(tensor, heads);
      }
    }
    if (mapped.empty() && !to_hf && name.find("rotary_emb") != std::string::npos) continue;  // buffers
    TITAN_USER_CHECK(!mapped.empty(), "tensor '", name, "' has no ", to_hf ? "Hugging Face" : "titan",
                     " counterpart for a llama3 model; is this checkpoint of another architecture?");
    out.emplace(mapped, value);
  }
  return out;
}

}  // namespace

HFAdapter hf_adapter(const ModelArgs& args) {
  return HFAdapter{[args](const StateDict& sd) { return convert(sd, args, true); },
                   [args](const StateDict& sd) { return convert(sd, args, false); }};
}

}  // namespace titan::llama3
