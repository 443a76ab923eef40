// The model families on the shared decoder (Llama 3, Llama 2, Qwen3), against Hugging Face
// transformers' own implementations (Qwen3ForCausalLM, LlamaForCausalLM via
// tests/reference/hf_reference.py):
//   - logits, loss and every parameter's gradient of small random models, titan's weights written as
//     a Hugging Face folder and its gradients compared through the adapter's name and row mapping;
//   - Hugging Face models of sizes no flavor has (head_dim not dim / n_heads, RoPE scaling factor
//     32, tied and untied) imported with `titan convert from-hf` through their own config.json, and
//     exported back: the logits survive both ways;
//   - the released models' parameter counts.
//
// Tolerances (fp32 on the CPU): logits, loss and gradients 1e-5 relative to each tensor's largest
// entry, the Llama3Parity tests' bound: both sides run fp32 ATen kernels and differ only in
// operation order (SDPA vs eager softmax attention, complex vs rotate-half RoPE).
#include "test_util.h"

#include "titan/components/checkpoint/checkpoint.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/models/common/decoder.h"
#include "titan/models/llama2/llama2.h"
#include "titan/models/llama3/args.h"
#include "titan/models/qwen3/qwen3.h"
#include "titan/models/registry.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>

namespace titan {
namespace {

namespace fs = std::filesystem;

const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";
const std::string kScript = std::string(TITAN_SOURCE_DIR) + "/tests/reference/hf_reference.py";
constexpr double kTol = 1e-5;

int64_t count(const std::string& model, const std::string& flavor) {
  return model_spec(model).build(flavor, at::TensorOptions().device(at::kMeta), 128)->num_params();
}

TEST(ModelFamilies, FlavorParameterCountsAreTheReleasedModels) {
  // The released models' parameter counts as transformers' num_parameters() reports them for
  // Qwen/Qwen3-* and meta-llama/Llama-2-*-hf (a tied table counted once: the Hub's file-size figure
  // for Qwen3-1.7B, 2.03B, counts the stored lm_head copy too).
  const std::vector<std::tuple<std::string, std::string, int64_t>> released = {
      {"qwen3", "0.6B", 596'049'920},        {"qwen3", "1.7B", 1'720'574'976},  {"qwen3", "4B", 4'022'468'096},
      {"qwen3", "8B", 8'190'735'360},        {"qwen3", "14B", 14'768'307'200},  {"qwen3", "32B", 32'762'123'264},
      {"llama2", "7B", 6'738'415'616},       {"llama2", "13B", 13'015'864'320}, {"llama2", "70B", 68'976'648'192},
      {"llama3", "8B", 8'030'261'248},       {"llama3", "70B", 70'553'706'496},
  };
  for (const auto& [model, flavor, n] : released) EXPECT_EQ(count(model, flavor), n) << model << " " << flavor;
  // The families list torchtitan's flavor names.
  EXPECT_EQ(model_spec("qwen3").flavors,
            (std::vector<std::string>{"debugmodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B", "debugmodel_moe",
                                      "30B-A3B", "235B-A22B"}));
  EXPECT_EQ(model_spec("llama2").flavors, (std::vector<std::string>{"debugmodel", "7B", "13B", "70B"}));
  EXPECT_EQ(model_spec("deepseek_v3").flavors, (std::vector<std::string>{"debugmodel", "16B", "236B", "671B"}));
  EXPECT_EQ(registered_models(), (std::vector<std::string>{"deepseek_v3", "llama2", "llama3", "qwen3"}));
}

TEST(ModelFamilies, FlopsPerTokenFollowTorchtitansFormula) {
  // 6 * (params - embedding) + 12 * layers * heads * head_dim * seq_len; Qwen3's heads are 128 wide
  // whatever dim is (0.6B: 16 heads of 128 = 2048 > dim 1024).
  const int64_t seq = 4096;
  LanguageModel m = model_spec("qwen3").build("0.6B", at::TensorOptions().device(at::kMeta), seq);
  const double expected = 6.0 * (596'049'920.0 - 151'936.0 * 1024.0) + 12.0 * 28 * 16 * 128 * seq;
  EXPECT_DOUBLE_EQ(m->flops_per_token(seq), expected);
  LanguageModel l2 = model_spec("llama2").build("7B", at::TensorOptions().device(at::kMeta), seq);
  EXPECT_DOUBLE_EQ(l2->flops_per_token(seq), 6.0 * (6'738'415'616.0 - 32000.0 * 4096) + 12.0 * 32 * 32 * 128 * seq);
}

TEST(ModelFamilies, EstimateCoversEveryFamilyOnTheMetaDevice) {
  // The dry run of a released size under 4D parallelism: the stage holding the tied output keeps a
  // copy of the embedding table (Qwen3 4B under PP), which the estimate counts.
  const std::vector<std::tuple<std::string, std::string, std::string>> runs = {
      {"qwen3", "32B", "32,762,123,264"}, {"qwen3", "4B", "4,022,468,096"}, {"llama2", "70B", "68,976,648,192"}};
  for (const auto& [model, flavor, params] : runs) {
    auto r = test::run_process({kTitan, "estimate", "--model.name", model, "--model.flavor", flavor,
                                "--training.seq_len", "4096", "--parallelism.tensor_parallel_degree", "8",
                                "--parallelism.pipeline_parallel_degree", "4", "--parallelism.data_parallel_shard_degree",
                                "8", "--training.local_batch_size", "4"},
                               {{"OMP_NUM_THREADS", "1"}});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("model: " + model + " " + flavor), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("parameters: " + params), std::string::npos) << r.output;
    std::printf("[titan estimate %s %s, tp 8 x pp 4 x fsdp 8]\n%s\n", model.c_str(), flavor.c_str(), r.output.c_str());
  }
}

// A shipped config whose header names its `titan estimate ... --world-size N` run fits 80 GB GPUs at
// that size, with the peak the header states (within 1 GiB).
TEST(ModelFamilies, ShippedConfigsFitTheLayoutTheirHeadersName) {
  int checked = 0;
  for (const auto& e : std::filesystem::directory_iterator(std::string(TITAN_SOURCE_DIR) + "/configs")) {
    std::ifstream in(e.path());
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    std::smatch m;
    const std::string flat = std::regex_replace(text, std::regex("\n# "), " ");
    if (!std::regex_search(flat, m, std::regex("`titan estimate --job.config_file configs/([a-z0-9_.]+) --world-size "
                                                 "([0-9]+)` puts the peak at about ([0-9]+) GiB")))
      continue;
    SCOPED_TRACE(e.path().string());
    EXPECT_EQ(m[1].str(), e.path().filename().string());
    auto r = test::run_process({kTitan, "estimate", "--job.config_file", e.path().string(), "--world-size", m[2].str()},
                               {{"OMP_NUM_THREADS", "1"}});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    std::smatch v;
    ASSERT_TRUE(std::regex_search(r.output, v, std::regex("verdict: fits: peak ([0-9.]+) GiB of 80.00 GiB"))) << r.output;
    EXPECT_NEAR(std::stod(v[1].str()), std::stod(m[3].str()), 1.0) << r.output;
    ++checked;
  }
  EXPECT_GE(checked, 5);  // Qwen3 debugmodel_moe, 30B-A3B and 235B-A22B, DeepSeek-V3 16B and 236B
}

// ---------------------------------------------------------------------------------------------
// Against transformers

// A titan model of `flavor` with random weights (norms too, so that a norm weight in the wrong
// place or order shows), and biases (zeros when initialized) random too.
LanguageModel random_model(const std::string& model, const std::string& flavor) {
  LanguageModel m = model_spec(model).build(flavor, at::TensorOptions().dtype(at::kFloat), 128);
  m->init_weights(7);
  at::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  for (auto& p : m->named_parameters())
    if (p.key().find("norm") != std::string::npos) p.value().copy_(1 + 0.3 * at::randn(p.value().sizes(), gen));
    else if (p.key().size() > 5 && p.key().compare(p.key().size() - 5, 5, ".bias") == 0)
      p.value().copy_(0.1 * at::randn(p.value().sizes(), gen));
  return m;
}

void write_config(const std::string& path, const nlohmann::json& config) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path) << config.dump(2);
}

struct GradCase {
  std::string model;
  nlohmann::json config;  // a Hugging Face config.json: the flavor
};

std::vector<GradCase> grad_cases() {
  const nlohmann::json qwen3 = {{"model_type", "qwen3"},       {"hidden_size", 64},   {"intermediate_size", 96},
                                {"num_attention_heads", 4},   {"num_key_value_heads", 2}, {"head_dim", 24},
                                {"num_hidden_layers", 2},     {"vocab_size", 300},   {"rms_norm_eps", 1e-6},
                                {"rope_theta", 1e6},          {"tie_word_embeddings", true}};
  nlohmann::json qwen3_untied = qwen3;
  qwen3_untied["tie_word_embeddings"] = false;
  qwen3_untied["num_key_value_heads"] = 4;
  const nlohmann::json llama2 = {{"model_type", "llama"},     {"hidden_size", 64},     {"intermediate_size", 172},
                                 {"num_attention_heads", 4}, {"num_hidden_layers", 2}, {"vocab_size", 300},
                                 {"rms_norm_eps", 1e-5},     {"rope_theta", 10000.0}, {"tie_word_embeddings", false}};
  nlohmann::json llama31 = llama2;
  llama31["num_key_value_heads"] = 2;
  llama31["rope_theta"] = 500000.0;
  llama31["rope_scaling"] = {{"rope_type", "llama3"},
                             {"factor", 32.0},
                             {"low_freq_factor", 1.0},
                             {"high_freq_factor", 4.0},
                             {"original_max_position_embeddings", 8192}};
  // Biases (transformers' attention_bias, and Llama's mlp_bias), with a tied Llama.
  nlohmann::json llama_biased_tied = llama31;
  llama_biased_tied["attention_bias"] = true;
  llama_biased_tied["mlp_bias"] = true;
  llama_biased_tied["tie_word_embeddings"] = true;
  nlohmann::json qwen3_biased = qwen3_untied;
  qwen3_biased["attention_bias"] = true;
  // Qwen3-MoE (model.name qwen3 reads it): a dense layer, then a layer of 8 experts, 2 per token,
  // which transformers stores one tensor per expert and titan stacks.
  nlohmann::json qwen3_moe = qwen3_untied;
  qwen3_moe["model_type"] = "qwen3_moe";
  qwen3_moe["num_experts"] = 8;
  qwen3_moe["num_experts_per_tok"] = 2;
  qwen3_moe["moe_intermediate_size"] = 32;
  qwen3_moe["norm_topk_prob"] = true;
  qwen3_moe["mlp_only_layers"] = {0};
  // DeepSeek-V3: multi-head latent attention with a query latent and YaRN, a dense layer, then a
  // MoE layer with a shared expert and sigmoid group-limited routing.
  const nlohmann::json deepseek_v3 = {
      {"model_type", "deepseek_v3"}, {"hidden_size", 64},      {"intermediate_size", 96},
      {"moe_intermediate_size", 32}, {"num_hidden_layers", 2}, {"first_k_dense_replace", 1},
      {"num_attention_heads", 4},    {"num_key_value_heads", 4}, {"n_routed_experts", 8}, {"n_shared_experts", 1},
      {"num_experts_per_tok", 2},    {"n_group", 2},           {"topk_group", 1},
      {"norm_topk_prob", true},      {"routed_scaling_factor", 2.5}, {"q_lora_rank", 16},
      {"kv_lora_rank", 32},          {"qk_nope_head_dim", 16}, {"qk_rope_head_dim", 8},
      {"v_head_dim", 16},            {"vocab_size", 300},      {"rms_norm_eps", 1e-6},
      {"rope_theta", 10000.0},       {"max_position_embeddings", 163840}, {"tie_word_embeddings", false},
      {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 40.0}, {"original_max_position_embeddings", 4096},
                        {"beta_fast", 32.0}, {"beta_slow", 1.0}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}}}};
  return {{"qwen3", qwen3},         {"qwen3", qwen3_untied}, {"llama2", llama2},
          {"llama3", llama31},      {"qwen3", qwen3_moe},    {"deepseek_v3", deepseek_v3},
          {"llama2", llama_biased_tied}, {"qwen3", qwen3_biased}};
}

TEST(ModelFamilies, LogitsLossAndEveryGradientEqualTransformers) {
  for (const GradCase& c : grad_cases()) {
    SCOPED_TRACE(c.model + " " + c.config.dump());
    test::TempDir dir;
    const std::string flavor = dir / "flavor/config.json";
    write_config(flavor, c.config);
    const ModelSpec& spec = model_spec(c.model);
    LanguageModel model = random_model(c.model, flavor);
    // titan's weights as a Hugging Face folder.
    {
      checkpoint::HFWriter writer(dir / "hf", spec, flavor, at::kFloat);
      for (const auto& p : model->named_parameters()) writer.add(p.key(), p.value().detach());
      writer.finish();
    }
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
    const at::Tensor seq = at::randint(model->vocab_size(), {2, 33}, gen, at::kLong);
    const at::Tensor tokens = seq.slice(1, 0, 32).contiguous(), labels = seq.slice(1, 1, 33).contiguous();
    safetensors::save(dir / "batch.safetensors", {{"tokens", tokens}, {"labels", labels}});
    auto r = test::run_process({test::python(), kScript, "grads", dir / "hf", dir / "batch.safetensors",
                                dir / "out.safetensors"},
                               {{"OMP_NUM_THREADS", "2"}});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto ref = safetensors::load(dir / "out.safetensors").tensors;

    const at::Tensor logits = model->forward(tokens);
    const at::Tensor loss = at::cross_entropy_loss(logits.flatten(0, 1), labels.flatten());
    loss.backward();
    EXPECT_LT(test::relative_error(logits.detach(), ref.at("logits")), kTol);
    EXPECT_LT(test::relative_error(loss.detach(), ref.at("loss")), kTol);
    // transformers' gradients in titan's names and layouts.
    StateDict hf_grads;
    for (const auto& [name, t] : ref) {
      if (name.rfind("grad.", 0) != 0) continue;
      const std::string hf_name = name.substr(5);
      // transformers 5 holds a MoE layer's experts fused in memory (mlp.experts.gate_up_proj (E, 2F,
      // D), gate first; mlp.experts.down_proj (E, D, F)); its checkpoints hold one tensor per expert.
      const auto fused = hf_name.find("mlp.experts.");
      if (fused != std::string::npos && hf_name.find('.', fused + 12) == std::string::npos) {
        const std::string prefix = hf_name.substr(0, fused + 12), what = hf_name.substr(fused + 12);
        const int64_t f = t.size(1) / 2;
        for (int64_t j = 0; j < t.size(0); ++j) {
          const std::string expert = prefix + std::to_string(j) + ".";
          if (what == "gate_up_proj") {
            hf_grads[expert + "gate_proj.weight"] = t[j].slice(0, 0, f);
            hf_grads[expert + "up_proj.weight"] = t[j].slice(0, f);
          } else {
            hf_grads[expert + what + ".weight"] = t[j];
          }
        }
        continue;
      }
      hf_grads[hf_name] = t;
    }
    if (c.config.at("tie_word_embeddings") == true) hf_grads.erase("lm_head.weight");  // the embedding's
    const StateDict grads = spec.hf_adapter(flavor).from_hf(hf_grads);
    ASSERT_EQ(grads.size(), model->named_parameters().size());
    double worst = 0;
    for (const auto& p : model->named_parameters()) {
      ASSERT_TRUE(grads.count(p.key())) << p.key();
      const double err = test::relative_error(p.value().grad(), grads.at(p.key()));
      EXPECT_LT(err, kTol) << p.key();
      worst = std::max(worst, err);
    }
    if (c.model == "qwen3") EXPECT_TRUE(grads.count("layers.1.attention.q_norm.weight"));
    std::printf("[%s vs transformers] %zu gradients, worst relative error %.2e\n", c.model.c_str(), grads.size(),
                worst);
  }
}

struct ImportCase {
  std::string model;
  nlohmann::json config;
};

// transformers' save_pretrained -> titan convert from-hf (no flavor: the folder's own config.json)
// -> titan's logits; then titan convert to-hf of that checkpoint (with the config file gone) ->
// transformers' logits again.
TEST(ModelFamilies, HuggingFaceModelsOfAnySizeImportAndExport) {
  std::vector<ImportCase> cases;
  for (const GradCase& c : grad_cases()) cases.push_back({c.model, c.config});
  for (const ImportCase& c : cases) {
    SCOPED_TRACE(c.model + " " + c.config.dump());
    test::TempDir dir;
    write_config(dir / "create.json", c.config);
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
    const at::Tensor tokens = at::randint(300, {2, 40}, gen, at::kLong);
    safetensors::save(dir / "tokens.safetensors", {{"tokens", tokens}});
    auto r = test::run_process({test::python(), kScript, "create", dir / "create.json", dir / "hf",
                                dir / "tokens.safetensors", dir / "created.safetensors"},
                               {{"OMP_NUM_THREADS", "2"}});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const at::Tensor hf_logits = safetensors::load(dir / "created.safetensors").tensors.at("logits");

    r = test::run_process({kTitan, "convert", "from-hf", dir / "hf", dir / "ckpt/step-0", "--model.name", c.model},
                          {{"OMP_NUM_THREADS", "2"}});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    checkpoint::Reader reader(dir / "ckpt/step-0");
    const nlohmann::json record = reader.info().at("model");
    ASSERT_TRUE(record.contains("hf_config")) << record.dump();
    const std::string flavor = record.at("hf_config").get<std::string>();
    // titan's model of the recorded arguments, with the imported weights.
    LanguageModel model = model_spec(c.model).build(flavor, at::TensorOptions().dtype(at::kFloat), 128);
    {
      at::NoGradGuard no_grad;
      for (auto& p : model->named_parameters()) {
        const auto shape = p.value().sizes().vec();
        p.value().copy_(reader.read("model." + p.key(), std::vector<int64_t>(shape.size(), 0), shape));
      }
      // DeepSeek-V3's routing biases come with the weights (Qwen3-MoE's checkpoints have none).
      for (const auto& [prefix, layer] : model->moe_layers()) {
        const std::string name = "model." + prefix + "expert_bias";
        EXPECT_EQ(reader.meta(name).has_value(), c.model == "deepseek_v3") << name;
        if (reader.meta(name)) layer->expert_bias.copy_(reader.read(name, {0}, {layer->expert_bias.size(0)}));
      }
    }
    at::Tensor logits;
    {
      at::NoGradGuard no_grad;
      logits = model->forward(tokens);
    }
    EXPECT_LT(test::relative_error(logits, hf_logits), kTol);

    fs::remove_all(dir / "hf");  // the checkpoint holds everything the export needs
    r = test::run_process({kTitan, "convert", "to-hf", dir / "ckpt/step-0", dir / "hf2"}, {{"OMP_NUM_THREADS", "2"}});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = test::run_process({test::python(), kScript, "load", dir / "hf2", dir / "tokens.safetensors",
                           dir / "loaded.safetensors"},
                          {{"OMP_NUM_THREADS", "2"}});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto loaded = safetensors::load(dir / "loaded.safetensors");
    EXPECT_LT(test::relative_error(loaded.tensors.at("logits"), hf_logits), kTol);
    const nlohmann::json report = nlohmann::json::parse(loaded.metadata.at("report"));
    for (const char* key : {"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"})
      EXPECT_TRUE(report.at(key).empty()) << key << ": " << report.at(key).dump();
  }
}

TEST(ModelFamilies, MoeExpertsAreOneHuggingFaceTensorPerExpert) {
  test::TempDir dir;
  const GradCase c = grad_cases()[4];
  ASSERT_EQ(c.config.at("model_type"), "qwen3_moe");
  const std::string flavor = dir / "flavor/config.json";
  write_config(flavor, c.config);
  const HFAdapter adapter = model_spec("qwen3").hf_adapter(flavor);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(2);
  const at::Tensor w1 = at::randn({8, 32, 64}, gen), w2 = at::randn({8, 64, 32}, gen), gate = at::randn({8, 64}, gen);
  const StateDict hf = adapter.to_hf({{"layers.1.moe.experts.w1", w1}, {"layers.1.moe.experts.w2", w2},
                                      {"layers.1.moe.router.gate.weight", gate}});
  ASSERT_EQ(hf.size(), 17u);
  EXPECT_TRUE(at::equal(hf.at("model.layers.1.mlp.experts.5.gate_proj.weight"), w1[5]));
  EXPECT_TRUE(at::equal(hf.at("model.layers.1.mlp.experts.7.down_proj.weight"), w2[7]));
  EXPECT_TRUE(at::equal(hf.at("model.layers.1.mlp.gate.weight"), gate));
  const StateDict back = adapter.from_hf(hf);
  ASSERT_EQ(back.size(), 3u);
  EXPECT_TRUE(at::equal(back.at("layers.1.moe.experts.w1"), w1));
  EXPECT_TRUE(at::equal(back.at("layers.1.moe.experts.w2"), w2));
  // A checkpoint missing an expert, or holding one the model does not have, is refused by name.
  StateDict missing = hf;
  missing.erase("model.layers.1.mlp.experts.3.gate_proj.weight");
  const std::string err = test::error_of([&] { adapter.from_hf(missing); });
  EXPECT_NE(err.find("7 of the 8 experts"), std::string::npos) << err;
  StateDict extra = hf;
  extra["model.layers.1.mlp.experts.8.up_proj.weight"] = w1[0];
  EXPECT_NE(test::error_of([&] { adapter.from_hf(extra); }).find("expert 8 of a model with 8 experts"), std::string::npos);
}

TEST(ModelFamilies, ConfigFieldsTitanCannotHonourAreNamed) {
  test::TempDir dir;
  const nlohmann::json base = grad_cases()[0].config;  // qwen3
  const std::vector<std::tuple<std::string, nlohmann::json, std::string>> bad = {
      {"mlp_bias", true, "mlp_bias is true"},  // Qwen3's feed-forwards have no biases
      {"attention_bias", "yes", "attention_bias is \"yes\""},
      {"use_sliding_window", true, "use_sliding_window is true"},
      {"hidden_act", "gelu", "hidden_act is \"gelu\""},
      {"model_type", "llama", "model_type is \"llama\""},
      {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}, "rope_scaling.rope_type is \"yarn\""},
      {"hidden_size", nullptr, "hidden_size is null"},
      {"attention_dropout", 0.1, "attention_dropout is 0.1"},
      {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}},
       "rope_scaling.original_max_position_embeddings is null"},
  };
  for (const auto& [field, value, says] : bad) {
    nlohmann::json c = base;
    c[field] = value;
    write_config(dir / "config.json", c);
    const std::string msg = test::error_of([&] { model_spec("qwen3").build(dir / "config.json", {}, 16); });
    EXPECT_NE(msg.find(says), std::string::npos) << field << ": " << msg;
    EXPECT_NE(msg.find(dir / "config.json"), std::string::npos) << msg;
  }
  const std::string msg = test::error_of([&] { model_spec("qwen3").build(dir / "missing/config.json", {}, 16); });
  EXPECT_NE(msg.find("no such file"), std::string::npos) << msg;
  const std::string unknown = test::error_of([&] { model_spec("llama2").build("34B", {}, 16); });
  EXPECT_NE(unknown.find("choose one of: debugmodel, 7B, 13B, 70B"), std::string::npos) << unknown;
}

// Absent fields take the defaults of transformers' config class, null ones too where the class says
// so, and both generations of RoPE settings read alike.
TEST(ModelFamilies, ConfigDefaultsAreTransformers) {
  test::TempDir dir;
  auto args_of = [&](const std::string& model, const nlohmann::json& c) {
    write_config(dir / "config.json", c);
    auto m = model_spec(model).build(dir / "config.json", at::TensorOptions().device(at::kMeta), 16);
    return dynamic_cast<DecoderImpl&>(*m).args();
  };
  const nlohmann::json sizes = {{"hidden_size", 64}, {"intermediate_size", 96}, {"num_attention_heads", 4},
                                {"num_hidden_layers", 1}, {"vocab_size", 300}};
  // Qwen3Config: head_dim 128 and 32 key/value heads when absent (null: the attention heads), eps 1e-6,
  // theta 10000, untied.
  nlohmann::json q = sizes;
  q["model_type"] = "qwen3";
  const std::string msg = test::error_of([&] { args_of("qwen3", q); });
  EXPECT_NE(msg.find("num_key_value_heads 32 does not divide num_attention_heads 4"), std::string::npos) << msg;
  q["num_key_value_heads"] = nullptr;
  DecoderArgs a = args_of("qwen3", q);
  EXPECT_EQ(a.head_dim(), 128);
  EXPECT_EQ(a.kv_heads(), 4);
  EXPECT_TRUE(a.qk_norm);
  EXPECT_DOUBLE_EQ(a.norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(a.rope_theta, 10000.0);
  EXPECT_FALSE(a.rope_scaling.has_value());
  EXPECT_FALSE(a.tie_embeddings);
  // LlamaConfig: head_dim = hidden / heads; transformers 4's rope_scaling with the old "type" key, and
  // transformers 5's rope_parameters, read alike; a null rope_type is the default RoPE.
  nlohmann::json l = sizes;
  l["rope_scaling"] = {{"type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  l["rope_theta"] = 500000.0;
  a = args_of("llama3", l);
  EXPECT_EQ(a.head_dim(), 16);
  EXPECT_FALSE(a.qk_norm);
  ASSERT_TRUE(a.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(a.rope_scaling->factor, 32.0);
  nlohmann::json v5 = sizes;
  v5["rope_parameters"] = l["rope_scaling"];
  v5["rope_parameters"]["rope_theta"] = 500000.0;
  const DecoderArgs b = args_of("llama3", v5);
  EXPECT_DOUBLE_EQ(b.rope_theta, 500000.0);
  ASSERT_TRUE(b.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(b.rope_scaling->factor, 32.0);
  v5["rope_parameters"] = {{"rope_type", nullptr}, {"rope_theta", nullptr}};
  const DecoderArgs c = args_of("llama2", v5);
  EXPECT_FALSE(c.rope_scaling.has_value());
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  // A folder holding config.json is a flavor too.
  EXPECT_EQ(args_of("llama2", sizes).dim, 64);
  EXPECT_EQ(model_spec("llama2").build(dir.path(), at::TensorOptions().device(at::kMeta), 16)->hidden_size(), 64);
}

// A checkpoint records its model's arguments; loading one into a model of the same shapes but other
// arguments (here RoPE scaling factor 32 against 8) is refused, naming the field.
TEST(ModelFamilies, ACheckpointOfOtherArgumentsIsRefused) {
  test::TempDir dir;
  nlohmann::json config = {{"model_type", "llama"},     {"hidden_size", 64},     {"intermediate_size", 172},
                           {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"num_hidden_layers", 2},
                           {"vocab_size", 2048},       {"rms_norm_eps", 1e-5},  {"rope_theta", 500000.0},
                           {"rope_scaling", {{"rope_type", "llama3"}, {"factor", 32.0}, {"low_freq_factor", 1.0},
                                             {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}}}};
  write_config(dir / "create.json", config);
  safetensors::save(dir / "tokens.safetensors", {{"tokens", at::zeros({1, 4}, at::kLong)}});
  auto r = test::run_process({test::python(), kScript, "create", dir / "create.json", dir / "hf",
                              dir / "tokens.safetensors", dir / "out.safetensors"},
                             {{"OMP_NUM_THREADS", "2"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = test::run_process({kTitan, "convert", "from-hf", dir / "hf", dir / "ckpt/step-0"}, {{"OMP_NUM_THREADS", "2"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  config["rope_scaling"]["factor"] = 8.0;
  write_config(dir / "factor8/config.json", config);
  auto train = [&](const std::string& flavor, const std::string& dump) {
    return test::run_process({kTitan, "train", "--job.config_file", std::string(TITAN_SOURCE_DIR) + "/configs/llama3_debugmodel.toml",
                              "--job.dump_folder", dump, "--model.flavor", flavor, "--training.seq_len", "32",
                              "--training.steps", "1", "--checkpoint.initial_load_path", dir / "ckpt/step-0"},
                             {{"OMP_NUM_THREADS", "2"}});
  };
  r = train(dir / "factor8/config.json", dir / "run8");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("holds a llama3 model of other arguments than model.flavor"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rope_scaling.factor is 32.0, the flavor has 8.0"), std::string::npos) << r.output;
  r = train(dir / "hf/config.json", dir / "run32");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("initial load of"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace titan
