#include "titan/models/llama3/hf_adapter.h"

#include "titan/common/error.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cmath>
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

std::string torch_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    default: throw UserError(std::string("Hugging Face export supports float32, bfloat16 and float16, not ") +
                             c10::toString(dtype));
  }
}

std::string config_json(const ModelArgs& args, at::ScalarType dtype) {
  nlohmann::json rope_scaling = nullptr;
  if (args.rope_scaling) {
    const RopeScaling& s = *args.rope_scaling;
    rope_scaling = {{"rope_type", "llama3"},
                    {"factor", s.factor},
                    {"low_freq_factor", s.low_freq_factor},
                    {"high_freq_factor", s.high_freq_factor},
                    {"original_max_position_embeddings", s.original_max_position_embeddings}};
  }
  const nlohmann::json cfg = {
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"hidden_size", args.dim},
      {"intermediate_size", args.ffn_hidden_dim()},
      {"num_attention_heads", args.n_heads},
      {"num_hidden_layers", args.n_layers},
      {"num_key_value_heads", args.kv_heads()},
      {"head_dim", args.head_dim()},
      {"hidden_act", "silu"},
      {"rms_norm_eps", args.norm_eps},
      {"rope_theta", args.rope_theta},
      {"rope_scaling", rope_scaling},
      {"max_position_embeddings", args.max_seq_len},
      {"vocab_size", args.vocab_size},
      {"tie_word_embeddings", args.tie_embeddings},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"torch_dtype", torch_dtype_name(dtype)},
      {"initializer_range", 0.02},
  };
  return cfg.dump(2) + "\n";
}

// The first field of an HF Llama config that differs from `args`, as "field is X, the flavor has Y".
// Absent fields take transformers' LlamaConfig defaults. RoPE settings are read from either
// rope_theta + rope_scaling (transformers 4) or rope_parameters (transformers 5).
std::string config_mismatch(const ModelArgs& args, const std::string& text) {
  nlohmann::json cfg;
  try {
    cfg = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw UserError(std::string("malformed JSON: ") + e.what());
  }
  TITAN_USER_CHECK(cfg.is_object(), "malformed config: not a JSON object");
  auto differs = [](const std::string& field, const nlohmann::json& value, const auto& expected) {
    return field + " is " + value.dump() + ", the flavor has " + nlohmann::json(expected).dump();
  };
  auto field = [&](const std::string& name, const nlohmann::json& fallback) {
    auto it = cfg.find(name);
    return it == cfg.end() || it->is_null() ? fallback : *it;
  };
  auto close = [](const nlohmann::json& v, double expected) {
    return v.is_number() && std::abs(v.get<double>() - expected) <= 1e-9 * std::abs(expected);
  };

  const nlohmann::json model_type = field("model_type", "llama");
  if (model_type != "llama") return differs("model_type", model_type, "llama");
  const std::vector<std::pair<std::string, int64_t>> ints = {
      {"hidden_size", args.dim},
      {"num_hidden_layers", args.n_layers},
      {"num_attention_heads", args.n_heads},
      {"num_key_value_heads", args.kv_heads()},
      {"vocab_size", args.vocab_size},
      {"intermediate_size", args.ffn_hidden_dim()},
  };
  for (const auto& [name, expected] : ints) {
    // LlamaConfig's num_key_value_heads defaults to num_attention_heads; nothing else has a usable default.
    const nlohmann::json v = name == "num_key_value_heads" ? field(name, field("num_attention_heads", nullptr))
                                                           : field(name, nullptr);
    if (!v.is_number_integer() || v.get<int64_t>() != expected) return differs(name, v, expected);
  }
  const nlohmann::json head_dim = field("head_dim", args.head_dim());
  if (head_dim != args.head_dim()) return differs("head_dim", head_dim, args.head_dim());
  const nlohmann::json act = field("hidden_act", "silu");
  if (act != "silu") return differs("hidden_act", act, "silu");
  for (const char* bias : {"attention_bias", "mlp_bias"})
    if (field(bias, false) != false) return differs(bias, field(bias, false), false);
  const nlohmann::json tied = field("tie_word_embeddings", false);
  if (tied != args.tie_embeddings) return differs("tie_word_embeddings", tied, args.tie_embeddings);
  const nlohmann::json eps = field("rms_norm_eps", 1e-6);
  if (!close(eps, args.norm_eps)) return differs("rms_norm_eps", eps, args.norm_eps);

  nlohmann::json rope = field("rope_parameters", field("rope_scaling", nlohmann::json::object()));
  if (!rope.is_object()) return differs("rope_scaling", rope, "an object or null");
  const nlohmann::json theta = rope.contains("rope_theta") ? rope["rope_theta"] : field("rope_theta", 10000.0);
  if (!close(theta, args.rope_theta)) return differs("rope_theta", theta, args.rope_theta);
  const nlohmann::json type = rope.value("rope_type", rope.value("type", nlohmann::json("default")));
  if (!args.rope_scaling) {
    if (type != "default") return differs("rope_scaling.rope_type", type, "default");
    return "";
  }
  if (type != "llama3") return differs("rope_scaling.rope_type", type, "llama3");
  const RopeScaling& s = *args.rope_scaling;
  const std::vector<std::pair<std::string, double>> scaling = {
      {"factor", s.factor},
      {"low_freq_factor", s.low_freq_factor},
      {"high_freq_factor", s.high_freq_factor},
      {"original_max_position_embeddings", static_cast<double>(s.original_max_position_embeddings)},
  };
  for (const auto& [name, expected] : scaling) {
    // transformers takes original_max_position_embeddings from max_position_embeddings when absent.
    const nlohmann::json v = rope.contains(name) ? rope[name]
                             : name == "original_max_position_embeddings" ? field("max_position_embeddings", nullptr)
                                                                          : nlohmann::json(nullptr);
    if (!close(v, expected)) return differs("rope_scaling." + name, v, expected);
  }
  return "";
}

}  // namespace

HFAdapter hf_adapter(const ModelArgs& args) {
  return HFAdapter{[args](const StateDict& sd) { return convert(sd, args, true); },
                   [args](const StateDict& sd) { return convert(sd, args, false); },
                   [args](at::ScalarType dtype) { return config_json(args, dtype); },
                   [args](const std::string& text) { return config_mismatch(args, text); }};
}

}  // namespace titan::llama3
