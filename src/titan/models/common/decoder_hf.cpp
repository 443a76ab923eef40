#include "titan/models/common/decoder_hf.h"

#include "titan/common/error.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <map>
#include <regex>

namespace titan {
namespace {

// Per-layer suffixes: titan name -> HF name. Attention (grouped-query, or DeepSeek's multi-head
// latent attention), then what every block has.
using Names = std::vector<std::pair<std::string, std::string>>;
const Names& attention_names() {
  static const Names names = {
      {"attention.wq.weight", "self_attn.q_proj.weight"},     {"attention.wk.weight", "self_attn.k_proj.weight"},
      {"attention.wv.weight", "self_attn.v_proj.weight"},     {"attention.wo.weight", "self_attn.o_proj.weight"},
      {"attention.q_norm.weight", "self_attn.q_norm.weight"}, {"attention.k_norm.weight", "self_attn.k_norm.weight"},
      // attention_bias
      {"attention.wq.bias", "self_attn.q_proj.bias"},         {"attention.wk.bias", "self_attn.k_proj.bias"},
      {"attention.wv.bias", "self_attn.v_proj.bias"},         {"attention.wo.bias", "self_attn.o_proj.bias"},
  };
  return names;
}
const Names& mla_names() {
  static const Names names = {
      {"attention.wq.weight", "self_attn.q_proj.weight"},
      {"attention.wq_a.weight", "self_attn.q_a_proj.weight"},
      {"attention.q_norm.weight", "self_attn.q_a_layernorm.weight"},
      {"attention.wq_b.weight", "self_attn.q_b_proj.weight"},
      {"attention.wkv_a.weight", "self_attn.kv_a_proj_with_mqa.weight"},
      {"attention.kv_norm.weight", "self_attn.kv_a_layernorm.weight"},
      {"attention.wkv_b.weight", "self_attn.kv_b_proj.weight"},
      {"attention.wo.weight", "self_attn.o_proj.weight"},
  };
  return names;
}
const Names& block_names() {
  static const Names names = {
      {"feed_forward.w1.weight", "mlp.gate_proj.weight"},   {"feed_forward.w2.weight", "mlp.down_proj.weight"},
      {"feed_forward.w3.weight", "mlp.up_proj.weight"},     {"attention_norm.weight", "input_layernorm.weight"},
      {"ffn_norm.weight", "post_attention_layernorm.weight"},
      // mlp_bias
      {"feed_forward.w1.bias", "mlp.gate_proj.bias"},       {"feed_forward.w2.bias", "mlp.down_proj.bias"},
      {"feed_forward.w3.bias", "mlp.up_proj.bias"},
  };
  return names;
}

// A MoE layer's router, shared experts and routing bias: titan suffix -> HF suffix (the bias only
// where the architecture stores one: DeepSeek's e_score_correction_bias).
const Names& moe_names() {
  static const Names names = {
      {"moe.router.gate.weight", "mlp.gate.weight"},
      {"moe.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight"},
      {"moe.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight"},
      {"moe.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight"},
      {"moe.expert_bias", "mlp.gate.e_score_correction_bias"},
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

// A MoE layer's routed experts: titan stacks them (layers.N.moe.experts.w1 (E, F, D), w3, w2 (E, D, F));
// transformers' checkpoints hold one tensor per expert (model.layers.N.mlp.experts.J.gate_proj.weight
// (F, D), up_proj, down_proj (D, F)).
const std::vector<std::pair<std::string, std::string>>& expert_names() {
  static const std::vector<std::pair<std::string, std::string>> names = {
      {"w1", "gate_proj"}, {"w3", "up_proj"}, {"w2", "down_proj"}};
  return names;
}

StateDict convert(const StateDict& in, const DecoderArgs& args, const HFDialect& dialect, bool to_hf) {
  static const std::regex titan_layer(R"(^layers\.(\d+)\.(.+)$)");
  static const std::regex hf_layer(R"(^model\.layers\.(\d+)\.(.+)$)");
  static const std::regex titan_experts(R"(^layers\.(\d+)\.moe\.experts\.(w[123])$)");
  static const std::regex hf_expert(R"(^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$)");
  // from HF: the experts of (layer, titan weight) by index, stacked once every tensor is read
  std::map<std::pair<int64_t, std::string>, std::map<int64_t, at::Tensor>> experts;
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
    // DeepSeek-V3's released checkpoints hold multi-token-prediction layers after the model's own
    // (model.layers.61.* of 61 layers), which transformers skips too.
    if (!to_hf && dialect.deepseek && std::regex_match(name, m, hf_layer) && std::stoll(m[1]) >= args.n_layers) continue;
    if (args.moe && mapped.empty()) {
      if (to_hf && std::regex_match(name, m, titan_experts)) {
        const std::string layer = m[1], w = m[2];
        for (const auto& [t, h] : expert_names())
          if (t == w)
            for (int64_t j = 0; j < tensor.size(0); ++j)
              out.emplace("model.layers." + layer + ".mlp.experts." + std::to_string(j) + "." + h + ".weight", tensor[j]);
        continue;
      }
      if (!to_hf && std::regex_match(name, m, hf_expert)) {
        const int64_t layer = std::stoll(m[1]), j = std::stoll(m[2]);
        TITAN_USER_CHECK(layer < args.n_layers && args.is_moe_layer(layer), "tensor '", name, "': layer ", layer,
                         " of this model (", args.n_layers, " layers, mixtures of experts from layer ",
                         args.moe->n_dense_layers, ") has no experts; is this checkpoint of another model?");
        TITAN_USER_CHECK(j < args.moe->num_experts, "tensor '", name, "': expert ", j, " of a model with ",
                         args.moe->num_experts, " experts");
        for (const auto& [t, h] : expert_names())
          if (h == m[3]) experts[{layer, t}][j] = tensor;
        continue;
      }
      if (std::regex_match(name, m, to_hf ? titan_layer : hf_layer)) {
        for (const auto& [t, h] : moe_names()) {
          if (m[2].str() != (to_hf ? t : h)) continue;
          // Only DeepSeek's checkpoints hold the routing bias; titan's own stays out of the others'.
          if (t == "moe.expert_bias" && !dialect.deepseek) break;
          mapped = to_hf ? "model.layers." + m[1].str() + "." + h : "layers." + m[1].str() + "." + t;
        }
        if (mapped.empty() && to_hf && m[2].str() == "moe.expert_bias") continue;
      }
    }
    if (mapped.empty() && std::regex_match(name, m, to_hf ? titan_layer : hf_layer)) {
      const std::string layer = m[1], suffix = m[2];
      Names names = args.mla ? mla_names() : attention_names();
      names.insert(names.end(), block_names().begin(), block_names().end());
      for (const auto& [t, h] : names) {
        if (suffix != (to_hf ? t : h)) continue;
        mapped = to_hf ? "model.layers." + layer + "." + h : "layers." + layer + "." + t;
        if (args.mla) break;  // stored as titan holds it (RoPE pairs interleaved in both)
        const int64_t heads = t == "attention.wq.weight" || t == "attention.wq.bias"   ? args.n_heads
                              : t == "attention.wk.weight" || t == "attention.wk.bias" ? args.kv_heads()
                                                                                       : 0;
        // A q/k bias is one entry per row of its projection: its rows move with them.
        const at::Tensor rows = tensor.dim() == 1 ? tensor.reshape({-1, 1}) : tensor;
        if (heads)
          value = (to_hf ? interleaved_to_halves(rows, heads) : halves_to_interleaved(rows, heads)).reshape(tensor.sizes());
        // A QK-norm weight scales the head's elements before the rotation: it follows the same order.
        if (t == "attention.q_norm.weight" || t == "attention.k_norm.weight") {
          const at::Tensor column = tensor.reshape({-1, 1});
          value = (to_hf ? interleaved_to_halves(column, 1) : halves_to_interleaved(column, 1)).reshape(tensor.sizes());
        }
      }
    }
    if (mapped.empty() && !to_hf && name.find("rotary_emb") != std::string::npos) continue;  // buffers
    // Only the parameters the model has (a QK-norm weight in a model without QK-norm has no counterpart).
    if (!mapped.empty() && !args.qk_norm && !args.mla && mapped.find("_norm.weight") != std::string::npos &&
        (mapped.find("q_norm") != std::string::npos || mapped.find("k_norm") != std::string::npos))
      mapped.clear();
    TITAN_USER_CHECK(!mapped.empty(), "tensor '", name, "' has no ", to_hf ? "Hugging Face" : "titan",
                     " counterpart for a ", dialect.model_type, " model (", dialect.architecture,
                     "); is this checkpoint of another architecture?");
    out.emplace(mapped, value);
  }
  for (auto& [key, by_index] : experts) {
    const auto& [layer, w] = key;
    const int64_t E = args.moe->num_experts;
    TITAN_USER_CHECK(static_cast<int64_t>(by_index.size()) == E, "layer ", layer, "'s experts (", w, "): ",
                     by_index.size(), " of the ", E, " experts' tensors were given; a Hugging Face MoE checkpoint "
                     "holds every expert (model.layers.", layer, ".mlp.experts.0 to ", E - 1, ")");
    std::vector<at::Tensor> stacked;
    for (auto& [j, t] : by_index) stacked.push_back(t);
    out.emplace("layers." + std::to_string(layer) + ".moe.experts." + w, at::stack(stacked));
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

// DeepSeek-V3's config.json fields of `a` (the form DeepseekV3Config reads), whether or not
// DeepseekV3ForCausalLM can run them (its router is always sigmoid: "scoring_func" records ours).
nlohmann::json deepseek_fields(const DecoderArgs& a) {
  TITAN_ASSERT(a.mla && a.moe, "a DeepSeek-V3 model has multi-head latent attention and MoE layers");
  const DecoderMLA& l = *a.mla;
  const DecoderMoE& m = *a.moe;
  nlohmann::json rope = nullptr;
  if (a.yarn) {
    const YarnRope& y = *a.yarn;
    // mscale and mscale_all_dim equal: the softmax scale grows by the mscale factor squared and the
    // rotations are not scaled (transformers' attention factor is their ratio).
    rope = {{"type", "yarn"},
            {"rope_type", "yarn"},
            {"factor", y.factor},
            {"original_max_position_embeddings", y.original_seq_len},
            {"beta_fast", y.beta_fast},
            {"beta_slow", y.beta_slow},
            {"mscale", y.mscale},
            {"mscale_all_dim", y.mscale}};
  }
  return {{"architectures", {"DeepseekV3ForCausalLM"}},
          {"model_type", "deepseek_v3"},
          {"hidden_size", a.dim},
          {"intermediate_size", a.ffn_hidden_dim()},
          {"moe_intermediate_size", m.hidden_dim},
          {"num_hidden_layers", a.n_layers},
          {"num_attention_heads", a.n_heads},
          {"num_key_value_heads", a.n_heads},
          {"n_routed_experts", m.num_experts},
          {"n_shared_experts", m.num_shared_experts},
          {"num_experts_per_tok", m.top_k},
          {"n_group", std::max<int64_t>(1, m.n_groups)},
          {"topk_group", std::max<int64_t>(1, m.topk_groups)},
          {"routed_scaling_factor", m.route_scale},
          {"norm_topk_prob", m.route_norm},
          {"scoring_func", m.score_func},
          {"first_k_dense_replace", m.n_dense_layers},
          {"q_lora_rank", l.q_lora_rank > 0 ? nlohmann::json(l.q_lora_rank) : nlohmann::json(nullptr)},
          {"kv_lora_rank", l.kv_lora_rank},
          {"qk_nope_head_dim", l.qk_nope_head_dim},
          {"qk_rope_head_dim", l.qk_rope_head_dim},
          {"v_head_dim", l.v_head_dim},
          {"hidden_act", "silu"},
          {"rms_norm_eps", a.norm_eps},
          {"rope_theta", a.rope_theta},
          {"rope_scaling", rope},
          {"rope_interleave", true},
          {"max_position_embeddings", a.max_seq_len},
          {"vocab_size", a.vocab_size},
          {"tie_word_embeddings", a.tie_embeddings},
          {"attention_bias", false}};
}

std::string config_json(const DecoderArgs& args, const HFDialect& dialect, at::ScalarType dtype) {
  if (dialect.deepseek) {
    nlohmann::json cfg = deepseek_fields(args);
    TITAN_USER_CHECK(cfg["scoring_func"] == "sigmoid", "DeepseekV3ForCausalLM routes with sigmoid scores: this "
                     "flavor's ", cfg["scoring_func"].get<std::string>(), " routing has no DeepseekV3 config.json form "
                     "(keep titan checkpoints for it)");
    cfg.erase("scoring_func");
    cfg["torch_dtype"] = torch_dtype_name(dtype);
    cfg["initializer_range"] = 0.02;
    return cfg.dump(2) + "\n";
  }
  nlohmann::json rope_scaling = nullptr;
  if (args.rope_scaling) {
    const RopeScaling& s = *args.rope_scaling;
    rope_scaling = {{"rope_type", "llama3"},
                    {"factor", s.factor},
                    {"low_freq_factor", s.low_freq_factor},
                    {"high_freq_factor", s.high_freq_factor},
                    {"original_max_position_embeddings", s.original_max_position_embeddings}};
  }
  nlohmann::json cfg = {
      {"architectures", {dialect.architecture}},
      {"model_type", dialect.model_type},
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
      {"attention_bias", args.attention_bias},
      {"torch_dtype", torch_dtype_name(dtype)},
      {"initializer_range", 0.02},
  };
  if (args.moe) {
    const DecoderMoE& m = *args.moe;
    TITAN_USER_CHECK(!dialect.moe_model_type.empty() && m.num_shared_experts == 0 && m.score_func == "softmax" &&
                         m.n_groups <= 1 && m.route_scale == 1.0,
                     "this mixture of experts (shared experts, sigmoid scores, group-limited routing or a route "
                     "scale) has no ", dialect.architecture, " config.json form");
    cfg["architectures"] = {dialect.moe_architecture};
    cfg["model_type"] = dialect.moe_model_type;
    cfg["num_experts"] = m.num_experts;
    cfg["num_experts_per_tok"] = m.top_k;
    cfg["moe_intermediate_size"] = m.hidden_dim;
    cfg["norm_topk_prob"] = m.route_norm;
    cfg["decoder_sparse_step"] = 1;
    std::vector<int64_t> dense;
    for (int64_t i = 0; i < m.n_dense_layers; ++i) dense.push_back(i);
    cfg["mlp_only_layers"] = dense;
    // transformers adds router_aux_loss_coef x its auxiliary loss only with output_router_logits.
    cfg["output_router_logits"] = m.aux_loss_coeff > 0;
    cfg["router_aux_loss_coef"] = m.aux_loss_coeff > 0 ? m.aux_loss_coeff : 0.001;
  }
  if (dialect.model_type == "llama") cfg["mlp_bias"] = args.mlp_bias;
  if (dialect.model_type == "qwen3") {  // and qwen3_moe
    cfg["use_sliding_window"] = false;
    cfg["sliding_window"] = nullptr;
    cfg["max_window_layers"] = args.n_layers;
  }
  return cfg.dump(2) + "\n";
}

// A transformers config.json read with the defaults of the dialect's config class: a field given
// as null counts as absent.
class HFConfig {
 public:
  HFConfig(const std::string& text, const HFDialect& dialect) : dialect_(dialect) {
    try {
      cfg_ = nlohmann::json::parse(text);
    } catch (const std::exception& e) {
      throw UserError(std::string("malformed JSON: ") + e.what());
    }
    TITAN_USER_CHECK(cfg_.is_object(), "malformed config: not a JSON object");
    // transformers 5 keeps the RoPE settings (theta included) in rope_parameters, 4 in rope_theta
    // and rope_scaling.
    rope_ = field("rope_parameters", field("rope_scaling", nlohmann::json::object()));
    if (!rope_.is_object()) fail("rope_scaling", rope_, "an object or null");
  }

  nlohmann::json field(const std::string& name, const nlohmann::json& fallback) const {
    auto it = cfg_.find(name);
    return it == cfg_.end() || it->is_null() ? fallback : *it;
  }
  bool given(const std::string& name) const { return cfg_.contains(name); }  // null included
  int64_t integer(const std::string& name, const nlohmann::json& fallback = nullptr) const {
    const nlohmann::json v = field(name, fallback);
    if (!v.is_number_integer() || v.get<int64_t>() <= 0) fail(name, v, "a positive integer");
    return v.get<int64_t>();
  }
  double number(const std::string& name, const nlohmann::json& v) const {
    if (!v.is_number() || !(v.get<double>() > 0)) fail(name, v, "a positive number");
    return v.get<double>();
  }
  // Throws: the field's value is not what titan can honour.
  [[noreturn]] void fail(const std::string& name, const nlohmann::json& value, const std::string& wanted) const {
    throw UserError(name + " is " + value.dump() + ": a " + dialect_.architecture + " that titan trains needs " +
                    wanted);
  }
  const nlohmann::json& rope() const { return rope_; }

 private:
  const HFDialect& dialect_;
  nlohmann::json cfg_, rope_;
};

}  // namespace

namespace {

// DeepseekV3Config's fields with its defaults for absent ones.
DecoderArgs deepseek_args_from_hf_config(const HFConfig& c) {
  const nlohmann::json model_type = c.field("model_type", "deepseek_v3");
  if (model_type != "deepseek_v3") c.fail("model_type", model_type, "\"deepseek_v3\"");
  DecoderArgs a;
  a.dim = c.integer("hidden_size");
  a.n_layers = c.integer("num_hidden_layers");
  a.n_heads = c.integer("num_attention_heads");
  a.vocab_size = c.integer("vocab_size");
  a.hidden_dim = c.integer("intermediate_size");
  a.max_seq_len = c.integer("max_position_embeddings", 4096);
  a.norm_eps = c.number("rms_norm_eps", c.field("rms_norm_eps", 1e-6));
  const nlohmann::json act = c.field("hidden_act", "silu");
  if (act != "silu") c.fail("hidden_act", act, "\"silu\" (SwiGLU feed-forward)");
  const nlohmann::json bias = c.field("attention_bias", false);
  if (bias != false) c.fail("attention_bias", bias, "false (titan's attention has no biases)");
  const nlohmann::json dropout = c.field("attention_dropout", 0.0);
  if (!dropout.is_number() || dropout.get<double>() != 0.0)
    c.fail("attention_dropout", dropout, "0 (titan trains without dropout)");
  const nlohmann::json interleave = c.field("rope_interleave", true);
  if (interleave != true) c.fail("rope_interleave", interleave, "true (RoPE pairs stored interleaved)");
  const nlohmann::json tied = c.field("tie_word_embeddings", false);
  if (tied != false) c.fail("tie_word_embeddings", tied, "false");
  DecoderMLA l;
  const nlohmann::json q_lora = c.field("q_lora_rank", c.given("q_lora_rank") ? nlohmann::json(0) : nlohmann::json(1536));
  if (!q_lora.is_number_integer() || q_lora.get<int64_t>() < 0) c.fail("q_lora_rank", q_lora, "null or a rank");
  l.q_lora_rank = q_lora.get<int64_t>();
  l.kv_lora_rank = c.integer("kv_lora_rank", 512);
  l.qk_nope_head_dim = c.integer("qk_nope_head_dim", 128);
  l.qk_rope_head_dim = c.integer("qk_rope_head_dim", 64);
  l.v_head_dim = c.integer("v_head_dim", 128);
  a.mla = l;
  DecoderMoE m;
  if (c.given("n_routed_experts") && c.given("num_local_experts") &&
      c.field("n_routed_experts", nullptr) != c.field("num_local_experts", nullptr))
    c.fail("n_routed_experts", c.field("n_routed_experts", nullptr), "the value of num_local_experts (one expert count)");
  m.num_experts = c.integer(c.given("num_local_experts") ? "num_local_experts" : "n_routed_experts", 256);
  const nlohmann::json shared = c.field("n_shared_experts", 1);
  if (!shared.is_number_integer() || shared.get<int64_t>() < 0) c.fail("n_shared_experts", shared, "a count");
  m.num_shared_experts = shared.get<int64_t>();
  m.top_k = c.integer("num_experts_per_tok", 8);
  m.hidden_dim = c.integer("moe_intermediate_size", 2048);
  m.n_groups = c.integer("n_group", 8);
  m.topk_groups = c.integer("topk_group", 4);
  if (m.n_groups == 1) m.n_groups = m.topk_groups = 0;  // one group: no group limit
  m.route_scale = c.number("routed_scaling_factor", c.field("routed_scaling_factor", 2.5));
  const nlohmann::json norm = c.field("norm_topk_prob", true);
  if (!norm.is_boolean()) c.fail("norm_topk_prob", norm, "true or false");
  m.route_norm = norm.get<bool>();
  // DeepseekV3ForCausalLM's router is always sigmoid (its config class has no scoring_func).
  m.score_func = "sigmoid";
  const nlohmann::json scoring = c.field("scoring_func", "sigmoid");
  if (scoring != "sigmoid") c.fail("scoring_func", scoring, "\"sigmoid\" (DeepseekV3ForCausalLM's router)");
  const nlohmann::json dense = c.field("first_k_dense_replace", 3);
  if (!dense.is_number_integer() || dense.get<int64_t>() < 0 || dense.get<int64_t>() > a.n_layers)
    c.fail("first_k_dense_replace", dense, "a layer count up to num_hidden_layers");
  m.n_dense_layers = dense.get<int64_t>();
  TITAN_USER_CHECK(m.top_k <= m.num_experts, "num_experts_per_tok ", m.top_k, " exceeds the ", m.num_experts, " experts");
  a.moe = m;
  const nlohmann::json& rope = c.rope();
  auto in_rope = [&](const std::string& name) { return rope.contains(name) && !rope[name].is_null(); };
  a.rope_theta = c.number("rope_theta", in_rope("rope_theta") ? rope["rope_theta"] : c.field("rope_theta", 10000.0));
  a.rope_scaling.reset();
  const nlohmann::json type = in_rope("rope_type") ? rope["rope_type"] : in_rope("type") ? rope["type"] : nlohmann::json("default");
  if (type == "yarn") {
    YarnRope y;
    auto get = [&](const std::string& name, const nlohmann::json& fallback) {
      return c.number("rope_scaling." + name, in_rope(name) ? rope[name] : fallback);
    };
    y.original_seq_len = static_cast<int64_t>(
        get("original_max_position_embeddings", c.field("original_max_position_embeddings", a.max_seq_len)));
    // Absent, transformers derives the factor from the two context lengths.
    y.factor = get("factor", static_cast<double>(a.max_seq_len) / static_cast<double>(y.original_seq_len));
    if (in_rope("truncate") && rope["truncate"] != true)
      c.fail("rope_scaling.truncate", rope["truncate"], "true (the correction range rounded outwards, as DeepSeek's)");
    y.beta_fast = get("beta_fast", 32.0);
    y.beta_slow = get("beta_slow", 1.0);
    // transformers scales the softmax by mscale_all_dim's factor squared and the rotations by
    // mscale's factor over mscale_all_dim's: titan implements equal ones (DeepSeek's checkpoints).
    if (!in_rope("mscale") || !in_rope("mscale_all_dim") || rope["mscale"] != rope["mscale_all_dim"])
      c.fail("rope_scaling.mscale", rope.value("mscale", nlohmann::json(nullptr)),
             "a value equal to rope_scaling.mscale_all_dim (both given)");
    y.mscale = get("mscale", nullptr);
    if (in_rope("attention_factor") && rope["attention_factor"] != 1.0)
      c.fail("rope_scaling.attention_factor", rope["attention_factor"], "1 (no scaling of the rotations)");
    a.yarn = y;
  } else if (type != "default") {
    c.fail("rope_scaling.rope_type", type, "\"yarn\" or \"default\" (the RoPE variants titan implements for DeepSeek-V3)");
  }
  a.validate();
  return a;
}

}  // namespace

DecoderArgs decoder_args_from_hf_config(const std::string& text, const HFDialect& dialect) {
  HFConfig c(text, dialect);
  if (dialect.deepseek) return deepseek_args_from_hf_config(c);
  const nlohmann::json model_type = c.field("model_type", dialect.model_type);
  const bool moe = !dialect.moe_model_type.empty() && model_type == dialect.moe_model_type;
  if (model_type != dialect.model_type && !moe)
    c.fail("model_type", model_type,
           "\"" + dialect.model_type + "\"" + (dialect.moe_model_type.empty() ? "" : " or \"" + dialect.moe_model_type + "\""));
  DecoderArgs a;
  a.dim = c.integer("hidden_size");
  a.n_layers = c.integer("num_hidden_layers");
  a.n_heads = c.integer("num_attention_heads");
  // Absent: the config class's default (Qwen3Config's is 32, Qwen3MoeConfig's 4); null: num_attention_heads.
  const int64_t default_kv_heads = moe ? dialect.moe_default_kv_heads : dialect.default_kv_heads;
  a.n_kv_heads = c.integer("num_key_value_heads", c.given("num_key_value_heads") || default_kv_heads == 0
                                                      ? a.n_heads
                                                      : default_kv_heads);
  a.vocab_size = c.integer("vocab_size");
  a.hidden_dim = c.integer("intermediate_size");
  // Absent: Qwen3Config's 128; Qwen3MoeConfig has none (hidden_size / num_attention_heads).
  const int64_t default_head_dim = moe ? dialect.moe_default_head_dim : dialect.default_head_dim;
  a.attention_head_dim = c.integer("head_dim", default_head_dim > 0 ? default_head_dim : a.dim / a.n_heads);
  TITAN_USER_CHECK(a.n_heads % a.n_kv_heads == 0, "num_key_value_heads ", a.n_kv_heads,
                   " does not divide num_attention_heads ", a.n_heads);
  const nlohmann::json act = c.field("hidden_act", "silu");
  if (act != "silu") c.fail("hidden_act", act, "\"silu\" (SwiGLU feed-forward)");
  const nlohmann::json attention_bias = c.field("attention_bias", false);
  if (!attention_bias.is_boolean()) c.fail("attention_bias", attention_bias, "true or false");
  a.attention_bias = attention_bias.get<bool>();
  // mlp_bias: LlamaMLP's; Qwen3's feed-forwards have no biases whatever the field says.
  const nlohmann::json mlp_bias = c.field("mlp_bias", false);
  if (dialect.model_type == "llama") {
    if (!mlp_bias.is_boolean()) c.fail("mlp_bias", mlp_bias, "true or false");
    a.mlp_bias = mlp_bias.get<bool>();
  } else if (mlp_bias != false) {
    c.fail("mlp_bias", mlp_bias, "false (" + dialect.architecture + "'s feed-forwards have no biases)");
  }
  const nlohmann::json dropout = c.field("attention_dropout", 0.0);
  if (!dropout.is_number() || dropout.get<double>() != 0.0)
    c.fail("attention_dropout", dropout, "0 (titan trains without dropout)");
  const nlohmann::json positions = c.field("max_position_embeddings", nullptr);
  if (!positions.is_null()) a.max_seq_len = c.integer("max_position_embeddings");
  if (dialect.model_type == "qwen3") {
    const nlohmann::json sliding = c.field("use_sliding_window", false);
    if (sliding != false) c.fail("use_sliding_window", sliding, "false (titan attends over the whole sequence)");
    const nlohmann::json types = c.field("layer_types", nlohmann::json::array());
    for (const auto& t : types)
      if (t != "full_attention") c.fail("layer_types", t, "\"full_attention\" in every layer");
  }
  const nlohmann::json tied = c.field("tie_word_embeddings", false);
  if (!tied.is_boolean()) c.fail("tie_word_embeddings", tied, "true or false");
  a.tie_embeddings = tied.get<bool>();
  a.norm_eps = c.number("rms_norm_eps", c.field("rms_norm_eps", 1e-6));
  if (moe) {
    // Qwen3MoeConfig's defaults for absent fields.
    DecoderMoE m;
    // transformers 5 writes the expert count as num_local_experts (num_experts is its alias).
    if (c.given("num_experts") && c.given("num_local_experts") &&
        c.field("num_experts", nullptr) != c.field("num_local_experts", nullptr))
      c.fail("num_experts", c.field("num_experts", nullptr), "the value of num_local_experts (one expert count)");
    m.num_experts = c.integer(c.given("num_local_experts") ? "num_local_experts" : "num_experts", 128);
    m.top_k = c.integer("num_experts_per_tok", 8);
    m.hidden_dim = c.integer("moe_intermediate_size", 768);
    const nlohmann::json norm = c.field("norm_topk_prob", false);
    if (!norm.is_boolean()) c.fail("norm_topk_prob", norm, "true or false");
    m.route_norm = norm.get<bool>();
    const nlohmann::json step = c.field("decoder_sparse_step", 1);
    if (step != 1) c.fail("decoder_sparse_step", step, "1 (every layer after the dense ones is MoE)");
    const nlohmann::json dense = c.field("mlp_only_layers", nlohmann::json::array());
    if (!dense.is_array()) c.fail("mlp_only_layers", dense, "a list of layer ids");
    for (size_t i = 0; i < dense.size(); ++i)
      if (dense[i] != static_cast<int64_t>(i))
        c.fail("mlp_only_layers", dense, "the first layers in order ([0, 1, ..., k-1]: dense layers come first)");
    m.n_dense_layers = static_cast<int64_t>(dense.size());
    if (m.n_dense_layers > a.n_layers) c.fail("mlp_only_layers", dense, "layer ids below num_hidden_layers");
    TITAN_USER_CHECK(m.top_k <= m.num_experts, "num_experts_per_tok ", m.top_k, " exceeds the ", m.num_experts,
                     " experts");
    // transformers' auxiliary loss is on with output_router_logits (titan's: the mean over the MoE
    // layers of its per-layer loss, docs/moe.md).
    const nlohmann::json aux = c.field("output_router_logits", false);
    if (!aux.is_boolean()) c.fail("output_router_logits", aux, "true or false");
    if (aux.get<bool>()) {
      m.aux_loss_coeff = c.number("router_aux_loss_coef", c.field("router_aux_loss_coef", 0.001));
      if (!(m.aux_loss_coeff >= 0))
        c.fail("router_aux_loss_coef", c.field("router_aux_loss_coef", nullptr), "a number >= 0");
    }
    a.moe = m;
  }
  a.qk_norm = dialect.qk_norm;
  const nlohmann::json& rope = c.rope();
  auto in_rope = [&](const std::string& name) { return rope.contains(name) && !rope[name].is_null(); };
  a.rope_theta = c.number("rope_theta", in_rope("rope_theta") ? rope["rope_theta"] : c.field("rope_theta", 10000.0));
  const nlohmann::json type = in_rope("rope_type") ? rope["rope_type"]
                              : in_rope("type")    ? rope["type"]
                                                   : nlohmann::json("default");
  if (type == "default") {
    a.rope_scaling.reset();
  } else if (type == "llama3") {
    RopeScaling s;
    // Every field of the llama3 type is required (as transformers requires it).
    auto get = [&](const std::string& name) {
      return c.number("rope_scaling." + name, in_rope(name) ? rope[name] : nlohmann::json(nullptr));
    };
    s.factor = get("factor");
    s.low_freq_factor = get("low_freq_factor");
    s.high_freq_factor = get("high_freq_factor");
    s.original_max_position_embeddings = static_cast<int64_t>(get("original_max_position_embeddings"));
    a.rope_scaling = s;
  } else {
    c.fail("rope_scaling.rope_type", type, "\"default\" or \"llama3\" (the RoPE variants titan implements)");
  }
  a.validate();
  return a;
}

namespace {

// The first field of a config.json that differs from `args`, as "field is X, the flavor has Y"
// (or why titan cannot honour the config). Absent fields take the dialect's config class defaults.
std::string config_mismatch(const DecoderArgs& args, const HFDialect& dialect, const std::string& text) {
  DecoderArgs got;
  try {
    got = decoder_args_from_hf_config(text, dialect);
  } catch (const UserError& e) {
    return e.what();
  }
  auto differs = [](const std::string& field, const auto& value, const auto& expected) {
    return field + " is " + nlohmann::json(value).dump() + ", the flavor has " + nlohmann::json(expected).dump();
  };
  if (dialect.deepseek) {  // field by field in the config's own form
    const nlohmann::json g = deepseek_fields(got), want = deepseek_fields(args);
    for (const auto& [key, value] : want.items()) {
      if (key == "max_position_embeddings") continue;  // changes neither the weights nor the computation
      const nlohmann::json& other = g.at(key);
      if (key == "rope_scaling" && value.is_object() && other.is_object()) {
        for (const auto& [k, v] : value.items())
          if (v != other.at(k) && !(v.is_number() && other.at(k).is_number() &&
                                    std::abs(v.get<double>() - other.at(k).get<double>()) <= 1e-9 * std::abs(v.get<double>())))
            return differs("rope_scaling." + k, other.at(k), v);
      } else if (value.is_number_float() || other.is_number_float()) {
        if (!other.is_number() || std::abs(other.get<double>() - value.get<double>()) > 1e-9 * std::abs(value.get<double>()))
          return differs(key, other, value);
      } else if (value != other) {
        return differs(key, other, value);
      }
    }
    return "";
  }
  auto close = [](double v, double expected) { return std::abs(v - expected) <= 1e-9 * std::abs(expected); };
  const std::vector<std::tuple<std::string, int64_t, int64_t>> ints = {
      {"hidden_size", got.dim, args.dim},
      {"num_hidden_layers", got.n_layers, args.n_layers},
      {"num_attention_heads", got.n_heads, args.n_heads},
      {"num_key_value_heads", got.kv_heads(), args.kv_heads()},
      {"vocab_size", got.vocab_size, args.vocab_size},
      {"intermediate_size", got.ffn_hidden_dim(), args.ffn_hidden_dim()},
      {"head_dim", got.head_dim(), args.head_dim()},
  };
  for (const auto& [name, value, expected] : ints)
    if (value != expected) return differs(name, value, expected);
  if (got.moe.has_value() != args.moe.has_value())
    return differs("model_type", got.moe ? dialect.moe_model_type : dialect.model_type,
                   args.moe ? dialect.moe_model_type : dialect.model_type);
  if (args.moe) {
    const DecoderMoE &g = *got.moe, &m = *args.moe;
    const std::vector<std::tuple<std::string, int64_t, int64_t>> moe_ints = {
        {"num_experts", g.num_experts, m.num_experts},
        {"num_experts_per_tok", g.top_k, m.top_k},
        {"moe_intermediate_size", g.hidden_dim, m.hidden_dim},
        {"mlp_only_layers (their count)", g.n_dense_layers, m.n_dense_layers},
    };
    for (const auto& [name, value, expected] : moe_ints)
      if (value != expected) return differs(name, value, expected);
    if (g.route_norm != m.route_norm) return differs("norm_topk_prob", g.route_norm, m.route_norm);
  }
  if (got.tie_embeddings != args.tie_embeddings)
    return differs("tie_word_embeddings", got.tie_embeddings, args.tie_embeddings);
  if (!close(got.norm_eps, args.norm_eps)) return differs("rms_norm_eps", got.norm_eps, args.norm_eps);
  if (got.qk_norm != args.qk_norm) return differs("model_type", dialect.model_type, args.qk_norm ? "qwen3" : "llama");
  if (got.attention_bias != args.attention_bias)
    return differs("attention_bias", got.attention_bias, args.attention_bias);
  if (got.mlp_bias != args.mlp_bias) return differs("mlp_bias", got.mlp_bias, args.mlp_bias);
  if (!close(got.rope_theta, args.rope_theta)) return differs("rope_theta", got.rope_theta, args.rope_theta);
  if (got.rope_scaling.has_value() != args.rope_scaling.has_value())
    return differs("rope_scaling.rope_type", got.rope_scaling ? "llama3" : "default",
                   args.rope_scaling ? "llama3" : "default");
  if (!args.rope_scaling) return "";
  const RopeScaling &g = *got.rope_scaling, &s = *args.rope_scaling;
  const std::vector<std::tuple<std::string, double, double>> scaling = {
      {"factor", g.factor, s.factor},
      {"low_freq_factor", g.low_freq_factor, s.low_freq_factor},
      {"high_freq_factor", g.high_freq_factor, s.high_freq_factor},
      {"original_max_position_embeddings", static_cast<double>(g.original_max_position_embeddings),
       static_cast<double>(s.original_max_position_embeddings)},
  };
  for (const auto& [name, value, expected] : scaling)
    if (!close(value, expected)) return differs("rope_scaling." + name, value, expected);
  return "";
}

}  // namespace

HFAdapter decoder_hf_adapter(const DecoderArgs& args, const HFDialect& dialect) {
  HFAdapter adapter{[args, dialect](const StateDict& sd) { return convert(sd, args, dialect, true); },
                    [args, dialect](const StateDict& sd) { return convert(sd, args, dialect, false); },
                    [args, dialect](at::ScalarType dtype) { return config_json(args, dialect, dtype); },
                    [args, dialect](const std::string& text) { return config_mismatch(args, dialect, text); }};
  if (args.moe) {
    // The router's gate and routing bias, as transformers keeps them (DeepSeek-V3's
    // _keep_in_fp32_modules_strict).
    adapter.keep_fp32 = [](const std::string& hf_name) {
      for (const std::string suffix : {".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"})
        if (hf_name.size() >= suffix.size() && hf_name.compare(hf_name.size() - suffix.size(), suffix.size(), suffix) == 0)
          return true;
      return false;
    };
  }
  return adapter;
}

}  // namespace titan
