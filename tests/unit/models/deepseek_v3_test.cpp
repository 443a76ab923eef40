// DeepSeek-V3 (multi-head latent attention with YaRN RoPE, dense first layers, MoE with shared experts
// and sigmoid group-limited routing) against transformers' DeepseekV3ForCausalLM
// (tests/reference/deepseek_v3_reference.py maps titan's weights into it):
//   - logits, loss, every parameter's gradient and every MoE layer's token counts per expert of small
//     random models, with and without a query latent, with a routing bias;
//   - YaRN's frequencies and softmax scale against the formulas;
//   - the released sizes' parameter counts (transformers' own counts) and active parameters;
//   - the deepseek_v3 config.json both ways and what titan cannot honour.
// Tolerances as the other families' (fp32 on the CPU): 1e-5 relative to each tensor's largest entry.
#include "moe_reference_check.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/models/common/decoder.h"
#include "titan/models/registry.h"
#include "titan/nn/mla.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace titan {
namespace {

namespace fs = std::filesystem;

const std::string kScript = std::string(TITAN_SOURCE_DIR) + "/tests/reference/deepseek_v3_reference.py";
constexpr double kTol = 1e-5;

LanguageModel build(const std::string& flavor, const at::TensorOptions& opts = at::TensorOptions().device(at::kMeta)) {
  return model_spec("deepseek_v3").build(flavor, opts, 128);
}

// A small DeepSeek-V3: one dense layer, then two MoE layers of 8 experts (2 per token, 2 groups of 4
// of which 1 is kept, route scale 2.5) and a shared expert; heads of 16 + 8 (RoPE) for q and k and 16
// for v (so v is padded for the attention kernel); YaRN over the rotary dims.
nlohmann::json small_config() {
  return {{"architectures", {"DeepseekV3ForCausalLM"}},
          {"model_type", "deepseek_v3"},
          {"hidden_size", 64},
          {"intermediate_size", 96},
          {"moe_intermediate_size", 32},
          {"num_hidden_layers", 3},
          {"first_k_dense_replace", 1},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 4},
          {"n_routed_experts", 8},
          {"n_shared_experts", 1},
          {"num_experts_per_tok", 2},
          {"n_group", 2},
          {"topk_group", 1},
          {"norm_topk_prob", true},
          {"routed_scaling_factor", 2.5},
          {"q_lora_rank", 16},
          {"kv_lora_rank", 32},
          {"qk_nope_head_dim", 16},
          {"qk_rope_head_dim", 8},
          {"v_head_dim", 12},
          {"vocab_size", 300},
          {"rms_norm_eps", 1e-6},
          {"rope_theta", 10000.0},
          {"max_position_embeddings", 163840},
          {"tie_word_embeddings", false},
          {"rope_scaling",
           {{"type", "yarn"}, {"rope_type", "yarn"}, {"factor", 40.0}, {"original_max_position_embeddings", 4096},
            {"beta_fast", 32.0}, {"beta_slow", 1.0}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}}}};
}

TEST(DeepseekV3, LogitsLossGradientsAndRoutingEqualTransformers) {
  nlohmann::json no_latent = small_config();
  no_latent["q_lora_rank"] = nullptr;
  for (const nlohmann::json& config : {small_config(), no_latent}) {
    SCOPED_TRACE(config.dump());
    test::TempDir dir;
    fs::create_directories(dir / "hf");
    std::ofstream(dir / "hf/config.json") << config.dump(2);
    LanguageModel model = build(dir / "hf/config.json", at::TensorOptions().dtype(at::kFloat));
    model->init_weights(3);
    const auto moe = model->moe_layers();
    ASSERT_EQ(moe.size(), 2u);
    {
      // Norms away from 1, and routing biases that change which experts are chosen.
      at::NoGradGuard no_grad;
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
      for (auto& p : model->named_parameters())
        if (p.key().find("norm") != std::string::npos) p.value().copy_(1 + 0.3 * at::randn(p.value().sizes(), gen));
      for (const auto& [prefix, layer] : moe) layer->expert_bias.copy_(0.05 * at::randn({8}, gen));
    }
    safetensors::Tensors weights;
    for (const auto& p : model->named_parameters()) weights[p.key()] = p.value().detach().contiguous();
    for (const auto& [prefix, layer] : moe) weights[prefix + "expert_bias"] = layer->expert_bias.clone();
    EXPECT_EQ(weights.count("layers.0.attention.wq_a.weight"), config["q_lora_rank"].is_null() ? 0u : 1u);
    EXPECT_TRUE(weights.count("layers.0.feed_forward.w1.weight"));
    EXPECT_TRUE(weights.count("layers.1.moe.shared_experts.w2.weight"));
    safetensors::save(dir / "weights.safetensors", weights);
    test::expect_moe_model_equals_reference(*model, kScript, dir.path(), "deepseek_v3", kTol);
  }
}

TEST(DeepseekV3, YarnFollowsItsFormulas) {
  // The 671B flavor's RoPE: 64 rotary dims, theta 1e4, factor 40 over 4,096 original positions,
  // beta 32 / 1. Correction dims: 64 ln(4096 / (2 pi beta)) / (2 ln 1e4): 10.2 for beta 32 (floor 10)
  // and 22.5 for beta 1 (ceil 23). Frequencies below index 10 are kept, above 23 divided by 40.
  nn::YarnScaling y;
  const at::Tensor f = nn::yarn_frequencies(64, 10000.0, y);
  ASSERT_EQ(f.numel(), 32);
  for (int64_t i = 0; i < 32; ++i) {
    const double base = std::pow(10000.0, -2.0 * static_cast<double>(i) / 64.0);
    const double ramp = std::clamp((static_cast<double>(i) - 10.0) / 13.0, 0.0, 1.0);
    EXPECT_NEAR(f[i].item<double>(), base / 40.0 * ramp + base * (1 - ramp), 1e-6 * base) << i;
  }
  // The softmax scale grows by (0.1 mscale ln 40 + 1)^2: 1.8739 for mscale 1, 1.5831 for 0.70.
  EXPECT_NEAR(y.softmax_scale(), std::pow(0.1 * std::log(40.0) + 1, 2), 1e-12);
  y.mscale = 0.70;
  EXPECT_NEAR(y.softmax_scale(), 1.5831, 1e-3);
}

TEST(DeepseekV3, FlavorsHaveTheReleasedParameterCountsAndActiveParameters) {
  // transformers' DeepseekV3ForCausalLM(config) parameter counts for the flavors' sizes (DeepSeek-V3
  // 671B; 236B and 16B are DeepSeek-V2's and V2-Lite's sizes).
  const std::vector<std::tuple<std::string, int64_t>> released = {{"debugmodel", 33'014'016},
                                                                  {"16B", 15'706'484'224},
                                                                  {"236B", 235'741'434'880},
                                                                  {"671B", 671'026'404'352}};
  for (const auto& [flavor, n] : released) EXPECT_EQ(build(flavor)->num_params(), n) << flavor;
  // Active parameters of 671B: 8 of 256 routed experts per token: DeepSeek-V3's 37B.
  LanguageModel m = build("671B");
  const double routed = 58.0 * 3 * 256 * 2048 * 7168;  // 58 MoE layers of 256 experts of 3 x 2048 x 7168
  const double active = static_cast<double>(m->num_params()) - routed * (1.0 - 8.0 / 256.0);
  EXPECT_NEAR(active / 1e9, 37.55, 0.01);
  // FLOPs per token: 6 x active non-embedding parameters + 6 x layers x heads x (192 + 128) x seq_len.
  const double emb = 129280.0 * 7168;
  const double want = 6.0 * (active - emb) + 6.0 * 61 * 128 * (192 + 128) * 4096;
  EXPECT_NEAR(m->flops_per_token(4096), want, 1e-9 * want);
  // The first 3 layers of 671B are dense, the rest MoE; multi-head latent attention everywhere.
  const auto named = m->named_parameters();
  EXPECT_TRUE(named.contains("layers.2.feed_forward.w1.weight"));
  EXPECT_TRUE(named.contains("layers.3.moe.experts.w1"));
  EXPECT_TRUE(named.contains("layers.3.attention.wq_a.weight"));
  EXPECT_TRUE(build("16B")->named_parameters().contains("layers.0.attention.wq.weight"));
}

TEST(DeepseekV3, ConfigJsonRoundTripsAndWhatTitanCannotHonourIsNamed) {
  const ModelSpec& spec = model_spec("deepseek_v3");
  // 671B's config.json describes 671B and no other flavor.
  const std::string text = spec.hf_adapter("671B").config_json(at::kBFloat16);
  const nlohmann::json written = nlohmann::json::parse(text);
  EXPECT_EQ(written.at("architectures"), nlohmann::json({"DeepseekV3ForCausalLM"}));
  EXPECT_EQ(written.at("n_routed_experts"), 256);
  EXPECT_EQ(written.at("first_k_dense_replace"), 3);
  EXPECT_EQ(written.at("rope_scaling").at("mscale_all_dim"), 1.0);
  EXPECT_EQ(spec.hf_adapter("671B").config_mismatch(text), "");
  EXPECT_NE(spec.hf_adapter("236B").config_mismatch(text), "");
  // The softmax-routed flavors have no DeepseekV3ForCausalLM form (its router is sigmoid).
  const std::string softmax = test::error_of([&] { spec.hf_adapter("16B").config_json(at::kFloat); });
  EXPECT_NE(softmax.find("routes with sigmoid scores"), std::string::npos) << softmax;
  // Fields titan cannot honour are named.
  test::TempDir dir;
  auto refused = [&](const std::string& key, const nlohmann::json& value, const std::string& says) {
    nlohmann::json c = small_config();
    if (key.rfind("rope_scaling.", 0) == 0)
      c["rope_scaling"][key.substr(13)] = value;
    else
      c[key] = value;
    std::ofstream(dir / "config.json") << c.dump();
    const std::string err = test::error_of([&] { build(dir / "config.json"); });
    EXPECT_NE(err.find(says), std::string::npos) << key << ": " << err;
  };
  refused("rope_scaling.mscale", 0.707, "rope_scaling.mscale");
  refused("rope_interleave", false, "rope_interleave");
  refused("hidden_act", "gelu", "hidden_act");
  refused("attention_bias", true, "attention_bias");
  refused("rope_scaling.rope_type", "dynamic", "rope_scaling.rope_type");
  refused("rope_scaling.truncate", false, "rope_scaling.truncate");
  refused("scoring_func", "softmax", "scoring_func");  // transformers' router is sigmoid whatever it says
  // max_position_embeddings changes neither weights nor computation: a config differing only there
  // still describes the flavor.
  nlohmann::json longer = nlohmann::json::parse(text);
  longer["max_position_embeddings"] = 163840;
  EXPECT_EQ(spec.hf_adapter("671B").config_mismatch(longer.dump()), "");
}

TEST(DeepseekV3, HuggingFaceWeightsSkipTheMtpLayerAndKeepTheRouterInFp32) {
  test::TempDir dir;
  nlohmann::json config = small_config();
  config["n_routed_experts"] = 12;  // "experts.10" sorts before "experts.2": files are not read in name order
  std::ofstream(dir / "config.json") << config.dump();
  const ModelSpec& spec = model_spec("deepseek_v3");
  const HFAdapter adapter = spec.hf_adapter(dir / "config.json");
  // The released checkpoints' multi-token-prediction layer (after the model's 3) is skipped.
  const at::Tensor w = at::ones({4, 64});
  EXPECT_TRUE(adapter.from_hf({{"model.layers.3.eh_proj.weight", w}, {"model.layers.3.mlp.experts.0.up_proj.weight", w}})
                  .empty());
  // Experts of a layer that has none are refused by name.
  const std::string err = test::error_of([&] { adapter.from_hf({{"model.layers.0.mlp.experts.0.up_proj.weight", w}}); });
  EXPECT_NE(err.find("has no experts"), std::string::npos) << err;
  // A bf16 export keeps the router's gate and routing bias in fp32, as transformers does.
  LanguageModel model = build(dir / "config.json", at::TensorOptions().dtype(at::kFloat));
  model->init_weights(1);
  {
    checkpoint::HFWriter writer(dir / "hf", spec, dir / "config.json", at::kBFloat16);
    for (const auto& p : model->named_parameters()) writer.add(p.key(), p.value().detach());
    for (const auto& [prefix, layer] : model->moe_layers()) writer.add(prefix + "expert_bias", layer->expert_bias);
    writer.finish();
  }
  const auto stored = safetensors::load(dir / "hf/model.safetensors").tensors;
  EXPECT_EQ(stored.at("model.layers.1.mlp.gate.weight").scalar_type(), at::kFloat);
  EXPECT_EQ(stored.at("model.layers.1.mlp.gate.e_score_correction_bias").scalar_type(), at::kFloat);
  EXPECT_EQ(stored.at("model.layers.1.mlp.experts.0.up_proj.weight").scalar_type(), at::kBFloat16);
  // Read back by blocks: a block of experts reads those experts' tensors only, and equals the
  // stacked weights (rounded to bf16 as written); the routing bias comes back too.
  checkpoint::HFSource source(dir / "hf", spec, dir / "config.json");
  const at::Tensor w2 = model->named_parameters()["layers.2.moe.experts.w2"].detach();  // (12, 64, 32)
  const at::Tensor block = source.read("model.layers.2.moe.experts.w2", {1, 16, 4}, {10, 8, 20});
  EXPECT_TRUE(at::equal(block.to(at::kFloat), w2.slice(0, 1, 11).slice(1, 16, 24).slice(2, 4, 24).to(at::kBFloat16).to(at::kFloat)));
  EXPECT_TRUE(at::equal(source.read("model.layers.2.moe.experts.w2", {0, 0, 0}, {12, 64, 32}).to(at::kFloat),
                        w2.to(at::kBFloat16).to(at::kFloat)));
  EXPECT_EQ(source.read("model.layers.2.moe.experts.w2", {12, 0, 0}, {0, 64, 32}).numel(), 0);
  ASSERT_TRUE(source.meta("model.layers.1.moe.expert_bias").has_value());
}

}  // namespace
}  // namespace titan
