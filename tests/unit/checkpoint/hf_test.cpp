// Hugging Face interop: titan checkpoints exported with `titan convert to-hf` load in transformers
// (LlamaForCausalLM.from_pretrained, tests/reference/hf_reference.py) and give titan's logits;
// models saved by transformers import with `titan convert from-hf` and give transformers' logits.
//
// Logits are compared as max|titan - transformers| / max|transformers| (test::relative_error).
// Tolerances, fp32 on the CPU: 1e-5. Both sides compute in fp32 from bit-identical weights and differ
// only in operation order (SDPA vs eager softmax attention, complex vs rotate-half RoPE, RMSNorm
// kernels), which leaves ~1e-6 (the Llama3Parity tests measure the same).
// bf16 export: the stored values are checked to be exactly titan's rounded to bf16, and transformers
// (upcasting them exactly to fp32) must give the logits of titan's model with bf16-rounded weights, 1e-5.
// A wrong Q/K permutation moves the logits of these models by 5e-4..4e-2 relative.
#include "models/tiny_llama.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/checkpoint.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/models/llama3/llama3.h"
#include "titan/models/llama3/model.h"
#include "titan/models/registry.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

namespace titan {
namespace {
namespace fs = std::filesystem;

const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";
const std::string kScript = std::string(TITAN_SOURCE_DIR) + "/tests/reference/hf_reference.py";
constexpr uint64_t kSeed = 1234;
constexpr double kTol = 1e-5;

at::Tensor make_tokens(int64_t vocab) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(42);
  return at::randint(vocab, {2, 48}, gen, at::kLong);
}

LanguageModel build(const ModelSpec& spec, const std::string& flavor) {
  LanguageModel m = spec.build(flavor, at::TensorOptions().dtype(at::kFloat), 128);
  m->init_weights(kSeed);
  return m;
}

at::Tensor logits_of(LanguageModelImpl& model, const at::Tensor& tokens) {
  at::NoGradGuard no_grad;
  return model.forward(tokens);
}

StateDict params_of(LanguageModelImpl& model) {
  StateDict out;
  for (const auto& p : model.named_parameters()) out[p.key()] = p.value().detach();
  return out;
}

void write_titan_checkpoint(const std::string& step_dir, LanguageModelImpl& model, const std::string& flavor) {
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [name, t] : params_of(model)) tensors["model." + name] = t;
  checkpoint::write_single_process(
      step_dir, tensors,
      {{"step", 10}, {"model", {{"name", "llama3"}, {"flavor", flavor}}}, {"contents", {"model"}}, {"world_size", 1},
       {"layout", "single process"}});
}

void write_hf(const std::string& dir, const ModelSpec& spec, const std::string& flavor, LanguageModelImpl& model,
              at::ScalarType dtype = at::kFloat, int64_t max_shard_bytes = 5'000'000'000) {
  checkpoint::HFWriter writer(dir, spec, flavor, dtype, max_shard_bytes);
  for (const auto& [name, t] : params_of(model)) writer.add(name, t);
  writer.finish();
}

struct HFResult {
  at::Tensor logits;
  nlohmann::json report;  // what transformers said while loading (see hf_reference.py)
};

// Runs hf_reference.py `command` with `paths` (then the tokens file and the output file appended).
HFResult run_transformers(const std::string& command, const std::vector<std::string>& paths, const at::Tensor& tokens,
                          const test::TempDir& dir, const std::vector<std::string>& flags = {}) {
  safetensors::save(dir / "tokens.safetensors", {{"tokens", tokens}});
  std::vector<std::string> cmd = {test::python(), kScript, command};
  cmd.insert(cmd.end(), paths.begin(), paths.end());
  cmd.insert(cmd.end(), {dir / "tokens.safetensors", dir / "hf_out.safetensors"});
  cmd.insert(cmd.end(), flags.begin(), flags.end());
  auto r = test::run_process(cmd, {{"OMP_NUM_THREADS", "2"}});
  if (r.exit_code != 0) throw std::runtime_error("hf_reference.py failed:\n" + r.output);
  auto file = safetensors::load(dir / "hf_out.safetensors");
  return {file.tensors.at("logits"), nlohmann::json::parse(file.metadata.at("report"))};
}

// transformers loaded every weight it expected, used every stored one, and warned about nothing.
void expect_clean_load(const nlohmann::json& report) {
  for (const char* key : {"missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs", "warnings"})
    EXPECT_TRUE(report.at(key).empty()) << key << ": " << report.at(key).dump(1);
}

test::ProcessResult titan_cli(const std::vector<std::string>& args) {
  std::vector<std::string> cmd = {kTitan};
  cmd.insert(cmd.end(), args.begin(), args.end());
  return test::run_process(cmd, {{"OMP_NUM_THREADS", "2"}});
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// A small Llama unlike any registered flavor: grouped-query attention, tied embeddings, no RoPE
// scaling (the other config.json branch), a vocabulary that is not a power of two.
ModelSpec tiny_spec() {
  llama3::ModelArgs args = test::tiny_llama(2, 300, 256);
  args.rope_theta = 10000.0;
  args.rope_scaling = std::nullopt;
  args.tie_embeddings = true;
  ModelSpec spec;
  spec.name = "llama3";
  spec.flavors = {"tiny"};
  spec.build = [args](const std::string&, const at::TensorOptions& opts, int64_t) -> LanguageModel {
    return std::make_shared<llama3::TransformerImpl>(args, opts);
  };
  spec.hf_adapter = [args](const std::string&) { return llama3::hf_adapter(args); };
  return spec;
}

// ---------------------------------------------------------------------------------------------
// titan -> Hugging Face

TEST(HFConvert, ToHFLoadsInTransformersWithTitansLogits) {
  test::TempDir dir;
  LanguageModel model = build(model_spec("llama3"), "debugmodel");
  write_titan_checkpoint(dir / "step-10", *model, "debugmodel");
  auto r = titan_cli({"convert", "to-hf", dir / "step-10", dir / "hf"});
  ASSERT_EQ(r.exit_code, 0) << r.output;

  EXPECT_TRUE(fs::exists(dir / "hf/model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "hf/model.safetensors.index.json")) << "one shard needs no index";
  const nlohmann::json config = read_json(dir / "hf/config.json");
  EXPECT_EQ(config.at("torch_dtype"), "float32");
  EXPECT_EQ(config.at("architectures"), nlohmann::json({"LlamaForCausalLM"}));
  EXPECT_EQ(config.at("rope_scaling").at("rope_type"), "llama3");
  EXPECT_EQ(safetensors::load(dir / "hf/model.safetensors").metadata.at("format"), "pt");

  const at::Tensor tokens = make_tokens(model->vocab_size());
  HFResult hf = run_transformers("load", {dir / "hf"}, tokens, dir);
  expect_clean_load(hf.report);
  const double err = test::relative_error(logits_of(*model, tokens), hf.logits);
  EXPECT_LT(err, kTol);
  std::printf("[to-hf debugmodel, transformers %s] logits relative error %.2e\n",
              hf.report.at("transformers_version").get<std::string>().c_str(), err);
}

TEST(HFConvert, ToHFBfloat16StoresRoundedWeightsAndDeclaresTheDtype) {
  test::TempDir dir;
  const ModelSpec& spec = model_spec("llama3");
  LanguageModel model = build(spec, "debugmodel");
  write_titan_checkpoint(dir / "step-10", *model, "debugmodel");
  auto r = titan_cli({"convert", "to-hf", dir / "step-10", dir / "hf", "--checkpoint.export_dtype", "bfloat16"});
  ASSERT_EQ(r.exit_code, 0) << r.output;

  EXPECT_EQ(read_json(dir / "hf/config.json").at("torch_dtype"), "bfloat16");
  const StateDict expected = spec.hf_adapter("debugmodel").to_hf(params_of(*model));
  const auto stored = safetensors::load(dir / "hf/model.safetensors").tensors;
  ASSERT_EQ(stored.size(), expected.size());
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(stored.count(name)) << name;
    EXPECT_EQ(stored.at(name).scalar_type(), at::kBFloat16) << name;
    EXPECT_TRUE(at::equal(stored.at(name), t.to(at::kBFloat16))) << name << " is not the bf16 rounding of titan's";
  }

  const at::Tensor tokens = make_tokens(model->vocab_size());
  HFResult hf = run_transformers("load", {dir / "hf"}, tokens, dir);
  expect_clean_load(hf.report);
  EXPECT_EQ(hf.report.at("config_dtype"), "bfloat16") << "transformers did not read the dtype from config.json";
  const double err_fp32 = test::relative_error(logits_of(*model, tokens), hf.logits);
  EXPECT_GT(err_fp32, 100 * kTol) << "bf16 rounding should move the logits far more than the tolerance";
  {
    at::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.copy_(p.to(at::kBFloat16));
  }
  const double err = test::relative_error(logits_of(*model, tokens), hf.logits);
  EXPECT_LT(err, kTol);
  std::printf("[to-hf bfloat16] logits relative error %.2e against titan with bf16-rounded weights (%.2e against fp32)\n",
              err, err_fp32);
}

TEST(HFWriter, ShardedFolderWithTiedEmbeddingsAndGQALoadsInTransformers) {
  test::TempDir dir;
  const ModelSpec spec = tiny_spec();
  LanguageModel model = build(spec, "tiny");
  write_hf(dir / "hf", spec, "tiny", *model, at::kFloat, /*max_shard_bytes=*/40'000);

  const nlohmann::json index = read_json(dir / "hf/model.safetensors.index.json");
  const StateDict expected = spec.hf_adapter("tiny").to_hf(params_of(*model));
  EXPECT_FALSE(expected.count("lm_head.weight")) << "tied embeddings store no lm_head";
  int64_t total = 0;
  std::set<std::string> files;
  for (const auto& [name, t] : expected) {
    total += t.numel() * t.element_size();
    ASSERT_TRUE(index.at("weight_map").contains(name)) << name;
    const std::string file = index.at("weight_map").at(name);
    files.insert(file);
    EXPECT_TRUE(at::equal(safetensors::load(dir / ("hf/" + file)).tensors.at(name), t)) << name;
  }
  EXPECT_EQ(index.at("weight_map").size(), expected.size());
  EXPECT_EQ(index.at("metadata").at("total_size").get<int64_t>(), total);
  ASSERT_GE(files.size(), 3u);
  char last[64];
  std::snprintf(last, sizeof(last), "model-%05zu-of-%05zu.safetensors", files.size(), files.size());
  EXPECT_TRUE(files.count(last)) << "shards are not named model-0000i-of-0000N: " << nlohmann::json(files).dump();
  for (const auto& entry : fs::directory_iterator(dir / "hf"))
    EXPECT_EQ(entry.path().filename().string().find("partial"), std::string::npos) << "left behind: " << entry.path();
  EXPECT_FALSE(fs::exists(dir / "hf/model.safetensors"));

  const at::Tensor tokens = make_tokens(model->vocab_size());
  HFResult hf = run_transformers("load", {dir / "hf"}, tokens, dir);
  expect_clean_load(hf.report);
  const double err = test::relative_error(logits_of(*model, tokens), hf.logits);
  EXPECT_LT(err, kTol);
  std::printf("[HFWriter tiny tied GQA, %zu shards] logits relative error %.2e\n", files.size(), err);
}

TEST(HFWriter, RejectsForeignOrMissingParameters) {
  test::TempDir dir;
  const ModelSpec spec = tiny_spec();
  LanguageModel model = build(spec, "tiny");
  checkpoint::HFWriter writer(dir / "hf", spec, "tiny", at::kFloat);
  EXPECT_THROW(writer.add("layers.9.attention.wq.weight", at::zeros({64, 64})), UserError);
  EXPECT_THROW(writer.add("norm.weight", at::zeros({65})), UserError);
  writer.add("norm.weight", at::ones({64}));
  EXPECT_THROW(writer.add("norm.weight", at::ones({64})), UserError);
  try {
    writer.finish();
    FAIL() << "finish() with parameters missing";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("was never given"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir / "hf/config.json"));
}

// ---------------------------------------------------------------------------------------------
// Hugging Face -> titan

// The debugmodel's shape as LlamaConfig arguments, written out here from the flavor's numbers.
nlohmann::json debugmodel_hf_config() {
  const llama3::ModelArgs a = llama3::flavor("debugmodel");
  const llama3::RopeScaling& s = *a.rope_scaling;
  return {{"hidden_size", a.dim},
          {"intermediate_size", a.ffn_hidden_dim()},
          {"num_hidden_layers", a.n_layers},
          {"num_attention_heads", a.n_heads},
          {"num_key_value_heads", a.kv_heads()},
          {"vocab_size", a.vocab_size},
          {"rms_norm_eps", a.norm_eps},
          {"rope_theta", a.rope_theta},
          {"rope_scaling",
           {{"rope_type", "llama3"}, {"factor", s.factor}, {"low_freq_factor", s.low_freq_factor},
            {"high_freq_factor", s.high_freq_factor},
            {"original_max_position_embeddings", s.original_max_position_embeddings}}},
          {"max_position_embeddings", a.max_seq_len},
          {"tie_word_embeddings", false}};
}

TEST(HFConvert, FromHFGivesTransformersLogits) {
  test::TempDir dir;
  {
    std::ofstream(dir / "config_args.json") << debugmodel_hf_config().dump();
  }
  const at::Tensor tokens = make_tokens(2048);
  HFResult hf = run_transformers("create", {dir / "config_args.json", dir / "hf"}, tokens, dir);
  expect_clean_load(hf.report);

  auto r = titan_cli({"convert", "from-hf", dir / "hf", dir / "ckpt/step-0"});  // flavor found from config.json
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("flavor debugmodel"), std::string::npos) << r.output;

  checkpoint::Reader reader(dir / "ckpt/step-0");
  EXPECT_EQ(reader.info().at("model").at("flavor"), "debugmodel");
  EXPECT_EQ(reader.info().at("step"), 0);
  LanguageModel model = model_spec("llama3").build("debugmodel", at::TensorOptions().dtype(at::kFloat), 128);
  std::vector<std::string> params;
  {
    at::NoGradGuard no_grad;
    for (const auto& p : model->named_parameters()) {
      const std::string name = "model." + p.key();
      params.push_back(name);
      auto meta = reader.meta(name);
      ASSERT_TRUE(meta) << name << " missing from the imported checkpoint";
      EXPECT_EQ(meta->dtype, at::kFloat) << name;
      p.value().copy_(reader.read(name, std::vector<int64_t>(meta->shape.size(), 0), meta->shape));
    }
  }
  std::sort(params.begin(), params.end());
  EXPECT_EQ(reader.names(), params) << "the checkpoint holds exactly the model's parameters";
  const double err = test::relative_error(logits_of(*model, tokens), hf.logits);
  EXPECT_LT(err, kTol);
  std::printf("[from-hf debugmodel] logits relative error %.2e\n", err);
}

TEST(HFSource, RoundTripsTitanWeightsExactlyBlockByBlock) {
  test::TempDir dir;
  const ModelSpec spec = tiny_spec();
  LanguageModel model = build(spec, "tiny");
  write_hf(dir / "hf", spec, "tiny", *model, at::kFloat, 40'000);
  checkpoint::HFSource source(dir / "hf", spec, "tiny");
  const StateDict params = params_of(*model);
  ASSERT_EQ(source.names().size(), params.size());
  for (const auto& [name, t] : params) {
    auto meta = source.meta("model." + name);
    ASSERT_TRUE(meta) << name;
    EXPECT_EQ(meta->shape, t.sizes().vec()) << name;
    EXPECT_EQ(meta->dtype, at::kFloat) << name;
    EXPECT_TRUE(at::equal(source.read("model." + name, std::vector<int64_t>(t.dim(), 0), t.sizes().vec()), t)) << name;
  }
  // A block of a permuted tensor (as a rank holding rows 8..23 of wk would read it).
  const at::Tensor wk = params.at("layers.1.attention.wk.weight");
  EXPECT_TRUE(at::equal(source.read("model.layers.1.attention.wk.weight", {8, 3}, {16, 40}),
                        wk.narrow(0, 8, 16).narrow(1, 3, 40)));
  EXPECT_FALSE(source.meta("model.output.weight")) << "tied: no output projection";
}

// ---------------------------------------------------------------------------------------------
// Errors name what is wrong

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(HFSource, ConfigOfAnotherShapeNamesTheField) {
  test::TempDir dir;
  const ModelSpec& spec = model_spec("llama3");
  LanguageModel model = build(spec, "debugmodel");
  write_hf(dir / "hf", spec, "debugmodel", *model);
  const nlohmann::json good = read_json(dir / "hf/config.json");
  auto with = [&](const std::string& field, const nlohmann::json& value) {
    nlohmann::json c = good;
    if (field == "rope_scaling.factor") c["rope_scaling"]["factor"] = value;
    else c[field] = value;
    std::ofstream(dir / "hf/config.json") << c.dump();
  };
  for (const auto& [field, value] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"hidden_size", 128}, {"num_key_value_heads", 4}, {"vocab_size", 32000}, {"intermediate_size", 1024},
           {"rope_theta", 10000.0}, {"tie_word_embeddings", true}, {"rms_norm_eps", 1e-6},
           {"num_hidden_layers", 7}, {"rope_scaling.factor", 32.0}}) {
    with(field, value);
    const std::string msg = error_of([&] { checkpoint::HFSource(dir / "hf", spec, "debugmodel"); });
    EXPECT_NE(msg.find(field + " is "), std::string::npos) << field << ": " << msg;
    EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
  }
  // transformers 5 writes RoPE settings as rope_parameters; they are read the same way.
  nlohmann::json v5 = good;
  v5["rope_parameters"] = v5["rope_scaling"];
  v5["rope_parameters"]["rope_theta"] = v5["rope_theta"];
  v5.erase("rope_scaling");
  v5.erase("rope_theta");
  std::ofstream(dir / "hf/config.json") << v5.dump();
  EXPECT_EQ(error_of([&] { checkpoint::HFSource(dir / "hf", spec, "debugmodel"); }), "(no error)");

  // The command line names the field too, and without --model.flavor lists every flavor's reason.
  with("hidden_size", 128);
  auto r = titan_cli({"convert", "from-hf", dir / "hf", dir / "out", "--model.flavor", "debugmodel"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("hidden_size is 128, the flavor has 256"), std::string::npos) << r.output;
  // Without --model.flavor a config that matches no flavor describes the model itself; here its
  // weights do not have the shapes it says, which is named.
  r = titan_cli({"convert", "from-hf", dir / "hf", dir / "out"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("' has shape [256,256] but llama3 flavor '" + dir / "hf/config.json" + "' needs [256,128]"),
            std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "out"));
}

TEST(HFSource, MissingOrUnknownTensorIsNamed) {
  test::TempDir dir;
  const ModelSpec spec = tiny_spec();
  LanguageModel model = build(spec, "tiny");
  const HFAdapter adapter = spec.hf_adapter("tiny");
  fs::create_directories(dir / "hf");
  std::ofstream(dir / "hf/config.json") << adapter.config_json(at::kFloat);
  StateDict hf = adapter.to_hf(params_of(*model));

  StateDict missing = hf;
  missing.erase("model.layers.1.self_attn.k_proj.weight");
  safetensors::save(dir / "hf/model.safetensors", missing, {{"format", "pt"}});
  std::string msg = error_of([&] { checkpoint::HFSource(dir / "hf", spec, "tiny"); });
  EXPECT_NE(msg.find("lacks tensor 'model.layers.1.self_attn.k_proj.weight'"), std::string::npos) << msg;

  StateDict unknown = hf;
  unknown["model.layers.0.self_attn.q_norm.weight"] = at::ones({16});
  safetensors::save(dir / "hf/model.safetensors", unknown, {{"format", "pt"}});
  msg = error_of([&] { checkpoint::HFSource(dir / "hf", spec, "tiny"); });
  EXPECT_NE(msg.find("'model.layers.0.self_attn.q_norm.weight' has no titan counterpart"), std::string::npos) << msg;

  StateDict wrong = hf;
  wrong["model.norm.weight"] = at::ones({65});
  safetensors::save(dir / "hf/model.safetensors", wrong, {{"format", "pt"}});
  msg = error_of([&] { checkpoint::HFSource(dir / "hf", spec, "tiny"); });
  EXPECT_NE(msg.find("'model.norm.weight' has shape [65]"), std::string::npos) << msg;

  // A tied model's stored lm_head (some savers keep it) is ignored.
  StateDict with_head = hf;
  with_head["lm_head.weight"] = hf.at("model.embed_tokens.weight");
  safetensors::save(dir / "hf/model.safetensors", with_head, {{"format", "pt"}});
  EXPECT_EQ(error_of([&] { checkpoint::HFSource(dir / "hf", spec, "tiny"); }), "(no error)");
}

TEST(HFSource, MissingFilesAreNamed) {
  test::TempDir dir;
  const ModelSpec spec = tiny_spec();
  fs::create_directories(dir / "hf");
  std::string msg = error_of([&] { checkpoint::HFSource(dir / "hf", spec, "tiny"); });
  EXPECT_NE(msg.find("has no config.json"), std::string::npos) << msg;

  std::ofstream(dir / "hf/config.json") << spec.hf_adapter("tiny").config_json(at::kFloat);
  msg = error_of([&] { checkpoint::HFSource(dir / "hf", spec, "tiny"); });
  EXPECT_NE(msg.find("has neither model.safetensors nor model.safetensors.index.json"), std::string::npos) << msg;

  LanguageModel model = build(spec, "tiny");
  fs::remove(dir / "hf/config.json");
  write_hf(dir / "hf", spec, "tiny", *model, at::kFloat, 40'000);
  const std::string shard = read_json(dir / "hf/model.safetensors.index.json").at("weight_map").at("model.norm.weight");
  fs::remove(dir / ("hf/" + shard));
  msg = error_of([&] { checkpoint::HFSource(dir / "hf", spec, "tiny"); });
  EXPECT_NE(msg.find(shard + ", which does not exist"), std::string::npos) << msg;
}

// An export a user loads whole: AutoTokenizer (the run's tokenizer, found through the run's
// config.toml, or given with --model.hf_assets_path) encodes a sentence to titan's ids, and
// AutoModelForCausalLM and GenerationConfig load with the tokenizer's BOS and EOS.
TEST(HFConvert, ToHFExportsTheRunsTokenizerAndAGenerationConfig) {
  test::TempDir dir;
  LanguageModel model = build(model_spec("llama3"), "debugmodel");
  write_titan_checkpoint(dir / "run/checkpoint/step-10", *model, "debugmodel");
  const std::string assets = std::string(TITAN_SOURCE_DIR) + "/assets/tokenizer";
  std::ofstream(dir / "run/config.toml") << "[model]\nhf_assets_path = \"" << assets << "\"\n";
  const std::string text = "Return the integer square root of n: the largest int r with r * r <= n.";
  std::ofstream(dir / "text.txt") << text;
  auto load = [&](const std::string& hf) {
    auto r = test::run_process({test::python(), std::string(TITAN_SOURCE_DIR) + "/tests/reference/hf_tokenizer_reference.py",
                                hf, dir / "text.txt", dir / "out.json"}, {}, std::chrono::seconds(300));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r.exit_code == 0 ? read_json(dir / "out.json") : nlohmann::json();
  };

  // tokenizer.json (byte-level BPE): copied with a tokenizer_config.json naming BOS and EOS.
  auto r = titan_cli({"convert", "to-hf", dir / "run/checkpoint/step-10", dir / "hf"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tokenizer: tokenizer.json, tokenizer_config.json (written) and generation_config.json"),
            std::string::npos) << r.output;
  auto titan = load_tokenizer(assets);
  std::vector<int32_t> want = titan->encode(text, /*add_bos=*/true);
  nlohmann::json got = load(dir / "hf");
  ASSERT_FALSE(got.is_null());
  EXPECT_EQ(got.at("ids").get<std::vector<int32_t>>(), want);
  EXPECT_EQ(got.at("decoded"), text);
  EXPECT_EQ(got.at("bos_token_id"), *titan->bos_id());
  EXPECT_EQ(got.at("eos_token_id"), *titan->eos_id());
  EXPECT_EQ(got.at("generation_bos"), *titan->bos_id());
  EXPECT_EQ(got.at("generation_eos"), *titan->eos_id());
  EXPECT_EQ(got.at("model_class"), "LlamaForCausalLM");

  // A SentencePiece model, named on the command line: tokenizer.model for LlamaTokenizer.
  r = titan_cli({"convert", "to-hf", dir / "run/checkpoint/step-10", dir / "hf-sp", "--model.hf_assets_path",
                 assets + "/sentencepiece.model"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("tokenizer: tokenizer.model (SentencePiece)"), std::string::npos) << r.output;
  auto sp = load_tokenizer(assets + "/sentencepiece.model");
  got = load(dir / "hf-sp");
  ASSERT_FALSE(got.is_null());
  EXPECT_EQ(got.at("ids").get<std::vector<int32_t>>(), sp->encode(text, /*add_bos=*/true)) << got.dump();
  EXPECT_EQ(got.at("generation_eos"), *sp->eos_id());

  // tiktoken: transformers needs a tokenizer.json; the export says so and still loads as a model.
  r = titan_cli({"convert", "to-hf", dir / "run/checkpoint/step-10", dir / "hf-tt", "--model.hf_assets_path",
                 assets + "/tiktoken.model"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("is a tiktoken model, and transformers reads a tokenizer.json"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(dir / "hf-tt/generation_config.json"));
  EXPECT_FALSE(fs::exists(dir / "hf-tt/tokenizer.model"));
}

// `titan convert to-dcp` and `to-torch`: PyTorch's own readers (torch.distributed.checkpoint.load into
// a state dict of the model's names, as torchtitan's initial_load_path does, and torch.load with
// weights_only) give the checkpoint's tensors bit for bit, in fp32 and in bf16; titan's from-dcp reads
// the folder back to the same checkpoint.
TEST(TorchConvert, ToDcpAndToTorchLoadInPyTorchBitForBit) {
  test::TempDir dir;
  LanguageModel model = build(model_spec("llama3"), "debugmodel");
  write_titan_checkpoint(dir / "step-10", *model, "debugmodel");
  // Qwen3's debug model ties its output projection to the embedding: torchtitan's state dict names
  // the table twice (output.weight too), titan's checkpoint once.
  LanguageModel tied = build(model_spec("qwen3"), "debugmodel");
  write_titan_checkpoint(dir / "tied/step-10", *tied, "debugmodel");
  ASSERT_EQ(params_of(*tied).count("output.weight"), 0u);
  for (const auto& [step, dtype] : std::vector<std::pair<std::string, std::string>>{
           {"step-10", "float32"}, {"step-10", "bfloat16"}, {"tied/step-10", "float32"}}) {
    SCOPED_TRACE(step + " " + dtype);
    const bool is_tied = step == "tied/step-10";
    LanguageModelImpl& m = is_tied ? *tied : *model;
    const std::string out = dir / (is_tied ? "tied-" + dtype : dtype);
    auto r = titan_cli({"convert", "to-dcp", dir / step, out + "-dcp", "--checkpoint.export_dtype", dtype});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    r = titan_cli({"convert", "to-torch", dir / step, out + ".pt", "--checkpoint.export_dtype", dtype});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("wrote " + std::to_string(params_of(m).size() + is_tied) + " tensors (" + dtype + ")"),
              std::string::npos) << r.output;
    std::map<std::string, at::Tensor> expected;
    for (const auto& [name, t] : params_of(m))
      expected[name] = t.to(dtype == "float32" ? at::kFloat : at::kBFloat16).contiguous();
    if (is_tied) expected["output.weight"] = expected.at("tok_embeddings.weight").clone();
    safetensors::save(out + "-ref.safetensors", expected);
    auto py = test::run_process({test::python(), std::string(TITAN_SOURCE_DIR) + "/tests/reference/torch_export_reference.py",
                                 out + "-ref.safetensors", out + "-dcp", out + ".pt"},
                                {{"OMP_NUM_THREADS", "2"}});
    ASSERT_EQ(py.exit_code, 0) << py.output;
    const nlohmann::json report = nlohmann::json::parse(py.output.substr(py.output.find('{')));
    std::vector<std::string> names;
    for (const auto& [name, t] : expected) names.push_back(name);
    EXPECT_EQ(report.at("dcp").at("names").get<std::vector<std::string>>(), names);
    EXPECT_TRUE(report.at("dcp").at("differ").empty()) << report.dump();
    EXPECT_EQ(report.at("dcp").at("dtypes"), nlohmann::json({"torch." + dtype}));
    EXPECT_EQ(report.at("torch").at("type"), "dict");
    EXPECT_EQ(report.at("torch").at("names").get<std::vector<std::string>>(), names);
    EXPECT_TRUE(report.at("torch").at("differ").empty()) << report.dump();
    EXPECT_EQ(report.at("torch").at("tied"), is_tied) << "a tied table is one storage";
  }
  // Back through from-dcp: the same weights.
  auto r = titan_cli({"convert", "from-dcp", dir / "float32-dcp", dir / "back/step-0", "--model.flavor", "debugmodel"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  checkpoint::Reader back(dir / "back/step-0");
  for (const auto& [name, t] : params_of(*model)) {
    const auto meta = back.meta("model." + name);
    ASSERT_TRUE(meta.has_value()) << name;
    EXPECT_TRUE(at::equal(back.read("model." + name, std::vector<int64_t>(meta->shape.size(), 0), meta->shape), t)) << name;
  }
  // Existing destinations and a folder of checkpoints are refused.
  r = titan_cli({"convert", "to-dcp", dir / "step-10", dir / "float32-dcp"});
  EXPECT_NE(r.output.find("already exists"), std::string::npos) << r.output;
  r = titan_cli({"convert", "to-torch", dir / "step-10", dir / "float32.pt"});
  EXPECT_NE(r.output.find("already exists: choose a new file"), std::string::npos) << r.output;
  r = titan_cli({"convert", "to-torch", dir / "step-10", dir / "outdir/"});
  EXPECT_NE(r.output.find("is a folder: give the file to write"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "outdir"));
  // A failure part way leaves nothing behind: a damaged checkpoint file.
  fs::create_directories(dir / "broken");
  fs::copy(dir / "step-10", dir / "broken/step-10", fs::copy_options::recursive);
  for (const auto& f : fs::directory_iterator(dir / "broken/step-10"))
    if (f.path().extension() == ".safetensors") fs::resize_file(f.path(), fs::file_size(f.path()) / 2);
  r = titan_cli({"convert", "to-dcp", dir / "broken/step-10", dir / "broken-dcp"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(dir / "broken-dcp")) << r.output;
  r = titan_cli({"convert", "to-torch", dir / "broken/step-10", dir / "broken.pt"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_FALSE(fs::exists(dir / "broken.pt") || fs::exists(dir / "broken.pt.tmp")) << r.output;
}

TEST(HFConvert, CommandLine) {
  auto r = titan_cli({"--help"});
  EXPECT_NE(r.output.find("convert"), std::string::npos) << r.output;
  r = titan_cli({"convert", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_NE(r.output.find("titan convert to-hf CHECKPOINT_STEP_DIR OUT_DIR"), std::string::npos) << r.output;
  r = titan_cli({"convert", "sideways", "a", "b"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("unknown conversion 'sideways'"), std::string::npos) << r.output;

  // A folder of checkpoints instead of one: the error points at a step folder.
  test::TempDir dir;
  LanguageModel debug = build(model_spec("llama3"), "debugmodel");
  write_titan_checkpoint(dir / "checkpoint/step-10", *debug, "debugmodel");
  r = titan_cli({"convert", "to-hf", dir / "checkpoint", dir / "hf"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("pass one of its step folders, e.g. " + dir / "checkpoint/step-10"), std::string::npos)
      << r.output;
  // The exported folder is not overwritten by a second export.
  ASSERT_EQ(titan_cli({"convert", "to-hf", dir / "checkpoint/step-10", dir / "hf"}).exit_code, 0);
  r = titan_cli({"convert", "to-hf", dir / "checkpoint/step-10", dir / "hf"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("already holds a Hugging Face model"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace titan
