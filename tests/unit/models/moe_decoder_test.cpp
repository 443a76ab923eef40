// Mixture-of-experts layers in the shared decoder (Qwen3-MoE), against transformers'
// Qwen3MoeForCausalLM (tests/reference/qwen3_moe_reference.py, which maps titan's weights into it):
//   - logits, loss, every parameter's gradient and every layer's token counts per expert of a small
//     random model (one dense layer first, then MoE layers of 8 experts, 2 per token);
//   - the released models' parameter counts and active parameters (FLOPs per token);
//   - the qwen3_moe config.json titan writes and reads, and the fields it cannot honour.
//
// Tolerances (fp32 on the CPU): logits, loss and gradients 1e-5 relative to each tensor's largest
// entry, as the dense families' comparison (tests/unit/models/families_test.cpp): both sides run
// fp32 ATen kernels and differ in operation order only; routing is discrete, so the counts are equal.
#include "moe_reference_check.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/models/common/decoder.h"
#include "titan/models/registry.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace titan {
namespace {

namespace fs = std::filesystem;

const std::string kScript = std::string(TITAN_SOURCE_DIR) + "/tests/reference/qwen3_moe_reference.py";
constexpr double kTol = 1e-5;

LanguageModel build(const std::string& flavor, const at::TensorOptions& opts = at::TensorOptions().device(at::kMeta)) {
  return model_spec("qwen3").build(flavor, opts, 128);
}

TEST(Qwen3Moe, FlavorsHaveTheReleasedParameterCountsAndActiveParameters) {
  // transformers' Qwen3MoeForCausalLM(config).num_parameters() for the released configs (and the
  // debug model's).
  const std::vector<std::tuple<std::string, int64_t>> released = {
      {"debugmodel_moe", 315'758'848}, {"30B-A3B", 30'532'122'624}, {"235B-A22B", 235'093'634'560}};
  for (const auto& [flavor, n] : released) EXPECT_EQ(build(flavor)->num_params(), n) << flavor;
  // FLOPs per token count active parameters: the routed experts' weights by top_k / num_experts
  // (8 of 128): 3.35B of 30B-A3B and 22.19B of 235B-A22B (their names' A3B and A22B), plus
  // torchtitan's attention term 12 * layers * heads * head_dim * seq_len.
  struct Active {
    std::string flavor;
    int64_t layers, heads, dim, vocab, experts, expert_hidden;
  };
  for (const Active& a : {Active{"30B-A3B", 48, 32, 2048, 151936, 128, 768}, Active{"235B-A22B", 94, 64, 4096, 151936, 128, 1536}}) {
    LanguageModel m = build(a.flavor);
    const double experts = static_cast<double>(a.layers * 3 * a.experts * a.expert_hidden * a.dim);
    const double active = static_cast<double>(m->num_params()) - experts * (1.0 - 8.0 / static_cast<double>(a.experts));
    const double emb = static_cast<double>(a.vocab * a.dim);
    const double want = 6.0 * (active - emb) + 12.0 * static_cast<double>(a.layers * a.heads * 128 * 4096);
    EXPECT_NEAR(m->flops_per_token(4096), want, 1e-9 * want) << a.flavor;
    std::printf("[%s] %.2fB parameters, %.2fB active\n", a.flavor.c_str(), static_cast<double>(m->num_params()) / 1e9,
                active / 1e9);
    EXPECT_NEAR(active / 1e9, a.flavor == "30B-A3B" ? 3.35 : 22.19, 0.01) << a.flavor;
  }
  // Every layer of Qwen3-MoE is a mixture of experts: no dense feed-forward anywhere.
  for (const auto& p : build("debugmodel_moe")->named_parameters())
    EXPECT_EQ(p.key().find("feed_forward"), std::string::npos) << p.key();
}

// A small Qwen3-MoE: one dense layer first (mlp_only_layers [0]), then two MoE layers.
nlohmann::json small_config() {
  return {{"architectures", {"Qwen3MoeForCausalLM"}},
          {"model_type", "qwen3_moe"},
          {"hidden_size", 64},
          {"intermediate_size", 96},
          {"num_hidden_layers", 3},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 16},
          {"num_experts", 8},
          {"num_experts_per_tok", 2},
          {"moe_intermediate_size", 32},
          {"norm_topk_prob", true},
          {"mlp_only_layers", {0}},
          {"vocab_size", 300},
          {"rms_norm_eps", 1e-6},
          {"rope_theta", 1e6},
          {"tie_word_embeddings", false},
          {"max_position_embeddings", 128}};
}

TEST(Qwen3Moe, LogitsLossGradientsAndRoutingEqualTransformers) {
  for (const bool aux : {false, true}) {
  SCOPED_TRACE(aux ? "with the auxiliary loss" : "without the auxiliary loss");
  test::TempDir dir;
  fs::create_directories(dir / "hf");
  nlohmann::json config = small_config();
  // transformers' auxiliary loss: output_router_logits and its coefficient (large enough to show in
  // every router's gradient).
  if (aux) {
    config["output_router_logits"] = true;
    config["router_aux_loss_coef"] = 0.5;
  }
  std::ofstream(dir / "hf/config.json") << config.dump(2);
  LanguageModel model = build(dir / "hf/config.json", at::TensorOptions().dtype(at::kFloat));
  EXPECT_EQ(dynamic_cast<DecoderImpl&>(*model).args().moe->aux_loss_coeff, aux ? 0.5 : 0.0);
  model->init_weights(3);
  {
    // Norm weights away from 1, so that a norm in the wrong place shows.
    at::NoGradGuard no_grad;
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
    for (auto& p : model->named_parameters())
      if (p.key().find("norm") != std::string::npos) p.value().copy_(1 + 0.3 * at::randn(p.value().sizes(), gen));
  }
  const auto moe = model->moe_layers();
  ASSERT_EQ(moe.size(), 2u);
  EXPECT_EQ(moe[0].first, "layers.1.moe.");
  safetensors::Tensors weights;
  for (const auto& p : model->named_parameters()) weights[p.key()] = p.value().detach().contiguous();
  EXPECT_TRUE(weights.count("layers.0.feed_forward.w1.weight"));
  EXPECT_EQ(weights.at("layers.2.moe.experts.w1").sizes(), at::IntArrayRef({8, 32, 64}));
  safetensors::save(dir / "weights.safetensors", weights);
  test::expect_moe_model_equals_reference(*model, kScript, dir.path(), aux ? "qwen3_moe aux" : "qwen3_moe", kTol,
                                          aux ? 0.5 : 0.0);
  }
}

TEST(Qwen3Moe, ConfigJsonRoundTripsAndWhatTitanCannotHonourIsNamed) {
  const ModelSpec& spec = model_spec("qwen3");
  for (const std::string flavor : {"debugmodel_moe", "30B-A3B", "235B-A22B"}) {
    const HFAdapter adapter = spec.hf_adapter(flavor);
    const nlohmann::json cfg = nlohmann::json::parse(adapter.config_json(at::kBFloat16));
    EXPECT_EQ(cfg.at("architectures"), nlohmann::json({"Qwen3MoeForCausalLM"})) << flavor;
    EXPECT_EQ(cfg.at("model_type"), "qwen3_moe");
    EXPECT_EQ(cfg.at("num_experts"), 128 - (flavor == "debugmodel_moe" ? 64 : 0));
    EXPECT_EQ(cfg.at("num_experts_per_tok"), 8);
    EXPECT_EQ(cfg.at("norm_topk_prob"), true);
    EXPECT_EQ(cfg.at("mlp_only_layers"), nlohmann::json::array());
    EXPECT_EQ(adapter.config_mismatch(cfg.dump()), "") << flavor;
    // The written config is a flavor: the same model.
    EXPECT_EQ(build(cfg.dump())->num_params(), build(flavor)->num_params()) << flavor;
  }
  const HFAdapter adapter = spec.hf_adapter("30B-A3B");
  nlohmann::json cfg = nlohmann::json::parse(adapter.config_json(at::kFloat));
  cfg["num_experts"] = 64;
  EXPECT_NE(adapter.config_mismatch(cfg.dump()).find("num_experts is 64"), std::string::npos);
  cfg = nlohmann::json::parse(adapter.config_json(at::kFloat));
  cfg["model_type"] = "qwen3";
  EXPECT_NE(adapter.config_mismatch(cfg.dump()).find("model_type"), std::string::npos);
  // Dense and MoE flavors of the same sizes are told apart.
  const std::string dense_vs_moe =
      spec.hf_adapter("debugmodel").config_mismatch(spec.hf_adapter("debugmodel_moe").config_json(at::kFloat));
  EXPECT_NE(dense_vs_moe.find("model_type is \"qwen3_moe\""), std::string::npos) << dense_vs_moe;

  auto refused = [&](const std::string& field, const nlohmann::json& value) {
    nlohmann::json c = small_config();
    c[field] = value;
    try {
      build(c.dump());
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("(accepted)");
  };
  EXPECT_NE(refused("decoder_sparse_step", 2).find("decoder_sparse_step"), std::string::npos);
  EXPECT_NE(refused("mlp_only_layers", {1}).find("mlp_only_layers"), std::string::npos);
  EXPECT_NE(refused("num_experts_per_tok", 9).find("num_experts_per_tok 9 exceeds the 8 experts"), std::string::npos);
  EXPECT_NE(refused("norm_topk_prob", "yes").find("norm_topk_prob"), std::string::npos);
  EXPECT_NE(refused("output_router_logits", "yes").find("output_router_logits"), std::string::npos);
  {
    // transformers' auxiliary loss is titan's: its coefficient read, and written back on export.
    nlohmann::json c = small_config();
    c["output_router_logits"] = true;
    c["router_aux_loss_coef"] = 0.01;
    EXPECT_EQ(dynamic_cast<DecoderImpl&>(*build(c.dump())).args().moe->aux_loss_coeff, 0.01);
    const nlohmann::json written = nlohmann::json::parse(spec.hf_adapter(c.dump()).config_json(at::kFloat));
    EXPECT_EQ(written.at("output_router_logits"), true);
    EXPECT_EQ(written.at("router_aux_loss_coef"), 0.01);
    c.erase("router_aux_loss_coef");  // Qwen3MoeConfig's default
    EXPECT_EQ(dynamic_cast<DecoderImpl&>(*build(c.dump())).args().moe->aux_loss_coeff, 0.001);
    c["router_aux_loss_coef"] = -1;
    EXPECT_NE(test::error_of([&] { build(c.dump()); }).find("router_aux_loss_coef"), std::string::npos);
    EXPECT_EQ(nlohmann::json::parse(spec.hf_adapter("30B-A3B").config_json(at::kFloat)).at("output_router_logits"), false);
  }
  EXPECT_NE(refused("mlp_only_layers", {0, 1, 2, 3}).find("mlp_only_layers"), std::string::npos);
  // Absent fields take Qwen3MoeConfig's defaults (4 KV heads; no head_dim: hidden_size / heads), and
  // the expert count transformers 5 writes as num_local_experts is read.
  nlohmann::json c = small_config();
  c.erase("head_dim");
  c.erase("num_key_value_heads");
  c.erase("num_experts");
  c["num_attention_heads"] = 8;
  c["num_local_experts"] = 16;
  LanguageModel m = build(c.dump());
  const DecoderArgs& args = dynamic_cast<DecoderImpl&>(*m).args();
  EXPECT_EQ(args.head_dim(), 8);
  EXPECT_EQ(args.kv_heads(), 4);
  EXPECT_EQ(args.moe->num_experts, 16);
  c["num_experts"] = 8;  // both, disagreeing
  try {
    build(c.dump());
    ADD_FAILURE() << "num_experts 8 with num_local_experts 16 was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("num_local_experts"), std::string::npos) << e.what();
  }
}

TEST(Qwen3Moe, EstimateDryRunsTheReleasedSizeOnTheMetaDevice) {
  // 30B-A3B under PP 4 x FSDP 8: the meta-device dry run routes without values (each expert's
  // grouped matmul as one of all the routed rows), and counts the parameters and active FLOPs.
  const std::string titan = std::string(TITAN_BINARY_DIR) + "/titan";
  const std::vector<std::string> base = {titan, "estimate", "--model.name", "qwen3", "--model.flavor", "30B-A3B",
                                         "--training.seq_len", "4096", "--training.local_batch_size", "1"};
  std::vector<std::string> argv = base;
  argv.insert(argv.end(), {"--parallelism.pipeline_parallel_degree", "4", "--parallelism.data_parallel_shard_degree", "8"});
  auto r = test::run_process(argv, {{"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("parameters: 30,532,122,624"), std::string::npos) << r.output;
  std::printf("[titan estimate qwen3 30B-A3B, pp 4 x fsdp 8]\n%s\n", r.output.c_str());
  // Under TP 2 x EP 4 (FSDP over 8 ranks of each tp index).
  argv = base;
  argv.insert(argv.end(), {"--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "8",
                           "--parallelism.expert_parallel_degree", "4"});
  r = test::run_process(argv, {{"OMP_NUM_THREADS", "1"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("TP 2 (sequence parallel) + EP 4"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ep: "), std::string::npos) << r.output;
}

}  // namespace
}  // namespace titan
