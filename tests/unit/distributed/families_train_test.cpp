// Every model family trains under every parallelism as one process does: the shipped debug configs
// of Qwen3 (QK-norm, heads of 128 over dim 256, tied embeddings) and Llama 2 (SentencePiece
// tokenizer, RoPE without scaling), 10 steps of 8 sequences of 32 tokens, under FSDP 2 (with CPU
// offload for Llama 2), TP 2 (sequence parallel and loss parallel), CP 2 and PP 2, through the real
// launcher. Tolerances as in launch_train_test.cpp: losses 1e-5 relative at every step, final
// weights within 1% of lr x steps.
//
// Qwen3's debug model ties its embeddings: under PP the first stage embeds with the table and the
// last projects with its own copy, their gradients summed after backward. A Hugging Face model of
// its own size trains from its config.json (--model.flavor) and weights (initial_load_in_hf).
#include "launched_training.h"
#include "test_util.h"

#include "titan/components/checkpoint/checkpoint.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/models/registry.h"

#include <ATen/ATen.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <tuple>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;
constexpr int kSteps = 10;
constexpr double kLr = 8e-4;

std::vector<std::string> train_args(const std::string& config, const std::string& dump,
                                    std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"train", "--job.config_file", kSource + "/configs/" + config, "--job.dump_folder",
                                   dump, "--training.seq_len", "32", "--training.local_batch_size", "8",
                                   "--training.global_batch_size", "8", "--training.steps", std::to_string(kSteps),
                                   "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "5"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

struct Layout {
  std::string name;
  std::vector<std::string> args;
  int nproc = 2;
};

// Point-to-point messages match by order, as on NCCL (see pipeline_train_test.cpp).
const std::map<std::string, std::string> kOrderMatched = {{"TITAN_P2P_ORDER_MATCHED", "1"}};

const std::vector<Layout>& layouts() {
  static const std::vector<Layout> all = {
      {"fsdp2", {"--training.local_batch_size", "4"}},
      {"tp2", {"--parallelism.tensor_parallel_degree", "2"}},
      {"cp2", {"--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"}},
  };
  return all;
}

// The "moe_imbalance", "moe_imbalance_max" and (with the auxiliary loss) "moe_aux_loss" figures of
// metrics.jsonl's training records, in order.
std::vector<double> moe_load_figures(const std::string& dump_folder) {
  std::vector<double> out;
  std::ifstream in(dump_folder + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.value("kind", "") != "train" || !j.contains("moe_imbalance")) continue;
    out.push_back(j.at("moe_imbalance").get<double>());
    out.push_back(j.at("moe_imbalance_max").get<double>());
    if (j.contains("moe_aux_loss")) out.push_back(j.at("moe_aux_loss").get<double>());
  }
  return out;
}

// Returns the single process's final weights and losses (and, when asked, its output and logged
// MoE figures). For MoE models the logged load imbalance of every layout equals the single
// process's too (the same tokens routed alike).
safetensors::Tensors expect_layouts_train_as_one_process(const std::string& config,
                                                         const std::vector<std::string>& model_args,
                                                         std::vector<Layout> runs, std::string* ref_output = nullptr,
                                                         std::vector<double>* ref_moe_figures = nullptr) {
  test::TempDir ref_dir;
  const test::LaunchedRun ref = test::run_titan(1, train_args(config, ref_dir.path(), model_args), ref_dir, kOrderMatched);
  EXPECT_EQ(ref.exit_code, 0) << ref.output;
  if (ref_output) *ref_output = ref.output;
  if (ref_moe_figures) *ref_moe_figures = moe_load_figures(ref_dir.path());
  if (ref.exit_code != 0) return {};
  const at::Tensor losses = ref.weights.at("__losses__");
  EXPECT_LT(losses[kSteps - 1].item<double>(), losses[0].item<double>()) << "the reference run did not learn";
  for (const Layout& layout : runs) {
    SCOPED_TRACE(config + " " + layout.name);
    test::TempDir dir;
    std::vector<std::string> extra = model_args;
    extra.insert(extra.end(), layout.args.begin(), layout.args.end());
    const test::LaunchedRun r = test::run_titan(layout.nproc, train_args(config, dir.path(), extra), dir, kOrderMatched);
    if (r.exit_code == 0) test::expect_same_training(ref.weights, r.weights, 0.01 * kLr * kSteps);
    const std::vector<double> load = moe_load_figures(dir.path()), ref_load = moe_load_figures(ref_dir.path());
    EXPECT_EQ(load.size(), ref_load.size());
    for (size_t i = 0; i < std::min(load.size(), ref_load.size()); ++i)
      EXPECT_NEAR(load[i], ref_load[i], 1e-6 * std::abs(ref_load[i])) << "logged figure " << i;  // fp32 sums
  }
  return ref.weights;
}

TEST(ModelFamiliesTrain, Qwen3DebugModelUnderEveryLayoutAndItsPipelineCheckpointResumesInOneProcess) {
  // The pipeline run ties the first stage's embedding to the last stage's output projection: the two
  // copies' gradients are summed, and its checkpoint (step 5) holds the table once.
  std::vector<Layout> runs = layouts();
  test::TempDir pp_dir;
  runs.push_back({"pp2",
                  {"--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                   "--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.folder", pp_dir / "checkpoint"}});
  // Each copy of the table sharded by FSDP, two microbatches accumulated per step.
  runs.push_back({"pp2_fsdp2_accumulating",
                  {"--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                   "--training.local_batch_size", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"},
                  4});
  // HSDP (2 replicas of 2 shards) with CPU offload and full activation checkpointing.
  runs.push_back({"hsdp2x2_offload_full_ac",
                  {"--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                   "--training.local_batch_size", "2", "--training.enable_cpu_offload", "--activation_checkpoint.mode",
                   "full"},
                  4});
  const safetensors::Tensors ref = expect_layouts_train_as_one_process("qwen3_debugmodel.toml", {}, runs);
  ASSERT_FALSE(ref.empty());

  ASSERT_TRUE(std::filesystem::exists(pp_dir / "checkpoint/step-5/index.json"));
  std::filesystem::remove_all(pp_dir / "checkpoint/step-10");
  test::TempDir dir;
  const test::LaunchedRun resumed = test::run_titan(
      1, train_args("qwen3_debugmodel.toml", dir.path(), {"--checkpoint.enable", "--checkpoint.folder", pp_dir / "checkpoint"}),
      dir);
  ASSERT_EQ(resumed.exit_code, 0);
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  ASSERT_EQ(resumed.weights.at("__losses__").numel(), 5);
  test::expect_same_training(ref, resumed.weights, 0.01 * kLr * kSteps, /*first_step=*/6);

  // And the other way: one process's checkpoint resumed under PP fills both copies of the table.
  test::TempDir one_dir, pp_resumed_dir;
  const test::LaunchedRun one = test::run_titan(
      1, train_args("qwen3_debugmodel.toml", one_dir.path(), {"--checkpoint.enable", "--checkpoint.interval", "5"}),
      one_dir);
  ASSERT_EQ(one.exit_code, 0);
  std::filesystem::remove_all(one_dir / "checkpoint/step-10");
  const test::LaunchedRun pp_resumed = test::run_titan(
      2, train_args("qwen3_debugmodel.toml", pp_resumed_dir.path(),
                    {"--checkpoint.enable", "--checkpoint.folder", one_dir / "checkpoint",
                     "--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"}),
      pp_resumed_dir, kOrderMatched);
  ASSERT_EQ(pp_resumed.exit_code, 0);
  ASSERT_EQ(pp_resumed.weights.at("__losses__").numel(), 5);
  test::expect_same_training(ref, pp_resumed.weights, 0.01 * kLr * kSteps, /*first_step=*/6);
}

TEST(ModelFamiliesTrain, AHuggingFaceQwen3OfItsOwnSizeContinuesPretrainingUnderPp) {
  // A randomly initialized Qwen3ForCausalLM of a size no flavor has (head_dim 48 over dim 64,
  // untied), saved by transformers, trained from its weights through its own config.json.
  test::TempDir dir;
  const nlohmann::json config = {{"model_type", "qwen3"},     {"hidden_size", 64},   {"intermediate_size", 160},
                                 {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 48},
                                 {"num_hidden_layers", 4},   {"vocab_size", 2048},  {"rms_norm_eps", 1e-6},
                                 {"rope_theta", 1e6},        {"tie_word_embeddings", false}};
  std::ofstream(dir / "create.json") << config.dump();
  at::Tensor tokens = at::zeros({1, 4}, at::kLong);
  safetensors::save(dir / "tokens.safetensors", {{"tokens", tokens}});
  auto r = test::run_process({test::python(), kSource + "/tests/reference/hf_reference.py", "create",
                              dir / "create.json", dir / "hf", dir / "tokens.safetensors", dir / "out.safetensors"},
                             {{"OMP_NUM_THREADS", "2"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<std::string> hf = {"--model.flavor", dir / "hf/config.json", "--checkpoint.initial_load_path",
                                       dir / "hf", "--checkpoint.initial_load_in_hf"};
  expect_layouts_train_as_one_process(
      "qwen3_debugmodel.toml", hf,
      {{"pp2", {"--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"}}});
  // The weights were loaded: without them the same model starts elsewhere.
  test::TempDir own;
  const test::LaunchedRun fresh =
      test::run_titan(1, train_args("qwen3_debugmodel.toml", own.path(), {"--model.flavor", dir / "hf/config.json"}), own);
  test::TempDir loaded_dir;
  std::vector<std::string> export_hf = hf;
  export_hf.insert(export_hf.end(), {"--checkpoint.enable", "--checkpoint.last_save_model_only",
                                     "--checkpoint.last_save_in_hf"});
  const test::LaunchedRun loaded =
      test::run_titan(1, train_args("qwen3_debugmodel.toml", loaded_dir.path(), export_hf), loaded_dir);
  EXPECT_GT(std::abs(fresh.weights.at("__losses__")[0].item<double>() - loaded.weights.at("__losses__")[0].item<double>()),
            1e-3);
  // The last save, in Hugging Face's format: a Qwen3ForCausalLM of this size holding the trained weights.
  const std::string exported = loaded_dir / "checkpoint/step-10";
  std::ifstream in(exported + "/config.json");
  const nlohmann::json written = nlohmann::json::parse(in);
  EXPECT_EQ(written.at("architectures"), nlohmann::json({"Qwen3ForCausalLM"}));
  EXPECT_EQ(written.at("head_dim"), 48);
  StateDict trained;
  for (const auto& [name, t] : loaded.weights)
    if (name != "__losses__") trained[name] = t;
  const StateDict expected = model_spec("qwen3").hf_adapter(dir / "hf/config.json").to_hf(trained);
  const auto stored = safetensors::load(exported + "/model.safetensors").tensors;
  ASSERT_EQ(stored.size(), expected.size());
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(stored.count(name)) << name;
    EXPECT_TRUE(at::equal(stored.at(name), t)) << name;
  }
}

TEST(ModelFamiliesTrain, Qwen3MoeUnderEveryLayoutAndItsCheckpointHoldsTheRoutingBiases) {
  // The small Qwen3-MoE from its config.json text (over the shipped qwen3_debugmodel_moe.toml, whose
  // 64-expert flavor it replaces): every layout routes the same tokens to the same
  // experts, and every step's routing-bias update counts the tokens of every data-parallel,
  // context-parallel and (under sequence parallelism) tensor-parallel rank (a rank that counted only
  // its own would steer differently from one process).
  const std::vector<std::string> moe = {"--model.flavor", test::qwen3_moe_config().dump()};
  test::TempDir one_dir;
  std::vector<Layout> runs = layouts();
  // Tensor parallelism: MoE layers replicated, each rank routing its part of the sequence (or, without
  // sequence parallelism, all of it).
  runs.push_back({"tp2_without_sequence_parallel",
                  {"--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "false"}});
  runs.push_back({"ddp2", {"--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                           "1", "--training.local_batch_size", "4"}});
  runs.push_back({"pp2", {"--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"}});
  // Evaluation routes without counting: validating every 2 steps leaves training as it is.
  runs.push_back({"validating", {"--validation.enable", "--validation.dataset", "c4_test", "--validation.freq", "2",
                                 "--validation.steps", "2"}, 1});
  runs.push_back({"full_ac_checkpointing_at_5",
                  {"--activation_checkpoint.mode", "full", "--checkpoint.enable", "--checkpoint.interval", "5",
                   "--checkpoint.folder", one_dir / "checkpoint"},
                  1});
  const safetensors::Tensors ref = expect_layouts_train_as_one_process("qwen3_debugmodel_moe.toml", moe, runs);
  ASSERT_FALSE(ref.empty());
  EXPECT_TRUE(ref.count("layers.2.moe.experts.w1"));
  // Each logged step says how unbalanced the two MoE layers' experts were: 1 is balanced, and at
  // most E / K = 4 (an expert receives at most one copy of each token, the mean is K / E of them).
  {
    test::TempDir dir;
    const test::LaunchedRun r = test::run_titan(1, train_args("qwen3_debugmodel_moe.toml", dir.path(), moe), dir);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::vector<double> load = moe_load_figures(dir.path());
    ASSERT_EQ(load.size(), 6u);  // steps 1, 5 and 10
    for (size_t i = 0; i < load.size(); i += 2) {
      EXPECT_GE(load[i], 1.0);
      EXPECT_GE(load[i + 1], load[i]);
      EXPECT_LE(load[i + 1], 4.0);
    }
    EXPECT_NE(r.output.find("moe_imbalance: "), std::string::npos) << r.output;
    // debug.moe_force_load_balance routes round-robin: every expert gets the same copies, and the
    // start-up log says the routers are overridden.
    test::TempDir forced;
    auto args = train_args("qwen3_debugmodel_moe.toml", forced.path(), moe);
    args.push_back("--debug.moe_force_load_balance");
    const test::LaunchedRun f = test::run_titan(1, args, forced);
    ASSERT_EQ(f.exit_code, 0) << f.output;
    const std::vector<double> balanced = moe_load_figures(forced.path());
    ASSERT_EQ(balanced.size(), 6u);
    for (double v : balanced) EXPECT_DOUBLE_EQ(v, 1.0);
    EXPECT_NE(f.output.find("debug.moe_force_load_balance: MoE tokens are routed round-robin"), std::string::npos)
        << f.output;
  }

  // The checkpoint holds each MoE layer's routing bias: moved by +-1e-3 per step towards balance,
  // then centred (the moves sum to zero; one move is at most 2e-3), so at most 1e-2 from zero after
  // 5 steps.
  {
    checkpoint::Reader reader(one_dir / "checkpoint/step-5");
    for (const std::string layer : {"1", "2"}) {
      const std::string name = "model.layers." + layer + ".moe.expert_bias";
      const auto meta = reader.meta(name);
      ASSERT_TRUE(meta.has_value()) << name;
      const at::Tensor bias = reader.read(name, {0}, {8});
      EXPECT_GT(bias.abs().max().item<double>(), 0.0) << name << bias;
      EXPECT_LE(bias.abs().max().item<double>(), 1e-2 + 1e-9) << name << bias;
      EXPECT_NEAR(bias.sum().item<double>(), 0.0, 1e-6) << name << bias;
    }
    EXPECT_FALSE(reader.meta("model.layers.0.moe.expert_bias").has_value());  // the dense layer
  }
  // Resumed at step 5, the run goes on as the uninterrupted one (the biases restored).
  std::filesystem::remove_all(one_dir / "checkpoint/step-10");
  test::TempDir dir;
  std::vector<std::string> resume = moe;
  resume.insert(resume.end(), {"--checkpoint.enable", "--checkpoint.folder", one_dir / "checkpoint"});
  const test::LaunchedRun resumed = test::run_titan(1, train_args("qwen3_debugmodel_moe.toml", dir.path(), resume), dir);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
  test::expect_same_training(ref, resumed.weights, 0.01 * kLr * kSteps, /*first_step=*/6);
}

TEST(ModelFamiliesTrain, Qwen3MoeUnderExpertParallelismAndItsCheckpointReshardsAcrossEpDegrees) {
  // The MoE model above, its 8 experts split over ep ranks taken from dp_shard x cp: each layout
  // trains as one process does (the routing biases updated every step), and a checkpoint written
  // with experts split over 2 ranks and sharded by FSDP over 2 resumes with them split over 4 and
  // in one process (expert weights are saved by global expert index).
  const std::vector<std::string> moe = {"--model.flavor", test::qwen3_moe_config().dump()};
  test::TempDir ckpt_dir;
  auto ep = [](int degree) { return std::vector<std::string>{"--parallelism.expert_parallel_degree", std::to_string(degree)}; };
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  const std::vector<Layout> runs = {
      {"ep2", with({"--training.local_batch_size", "4"}, ep(2))},
      {"ep4", with({"--training.local_batch_size", "2"}, ep(4)), 4},
      {"ep2_efsdp2_checkpointing_at_5",
       with({"--training.local_batch_size", "2", "--checkpoint.enable", "--checkpoint.interval", "5",
             "--checkpoint.folder", ckpt_dir / "checkpoint"},
            ep(2)),
       4},
      {"ep2_over_cp2", with({"--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"}, ep(2))},
      {"pp2_ep2", with({"--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"}, ep(2)), 4},
      // Attention split by TP 2 (sequence parallel), the experts over ep 2 within each tp index,
      // checkpointed (routing biases replicated over dp x cp and tp: one writer).
      {"tp2_ep2_checkpointing",
       with({"--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4", "--checkpoint.enable",
             "--checkpoint.interval", "5"},
            ep(2)),
       4},
      {"hsdp_ep2_full_ac",
       with({"--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "2",
             "--activation_checkpoint.mode", "full"},
            ep(2)),
       4},
  };
  const safetensors::Tensors ref = expect_layouts_train_as_one_process("qwen3_debugmodel_moe.toml", moe, runs);
  ASSERT_FALSE(ref.empty());

  ASSERT_TRUE(std::filesystem::exists(ckpt_dir / "checkpoint/step-5/index.json"));
  const std::vector<std::string> resume = {"--checkpoint.enable", "--checkpoint.folder", ckpt_dir / "checkpoint"};
  for (const auto& [name, nproc, args] :
       std::vector<std::tuple<std::string, int, std::vector<std::string>>>{
           {"ep4", 4, with({"--training.local_batch_size", "2"}, ep(4))}, {"one process", 1, {}}}) {
    SCOPED_TRACE("resumed under " + name);
    std::filesystem::remove_all(ckpt_dir / "checkpoint/step-10");  // each resume starts from step 5
    test::TempDir dir;
    const test::LaunchedRun resumed =
        test::run_titan(nproc, train_args("qwen3_debugmodel_moe.toml", dir.path(), with(with(moe, resume), args)), dir, kOrderMatched);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("resumed from"), std::string::npos) << resumed.output;
    ASSERT_EQ(resumed.weights.at("__losses__").numel(), 5);
    test::expect_same_training(ref, resumed.weights, 0.01 * kLr * kSteps, /*first_step=*/6);
  }

  // Degrees that cannot work are refused at start-up, saying what to choose.
  auto refused = [&](const std::vector<std::string>& args, const std::string& says) {
    SCOPED_TRACE(says);
    test::TempDir dir;
    std::vector<std::string> argv = {std::string(TITAN_BINARY_DIR) + "/titan", "launch", "--nproc-per-node", "2",
                                     "--master-port", "0", "--"};
    for (const auto& a : train_args("qwen3_debugmodel.toml", dir.path(), args)) argv.push_back(a);
    const test::ProcessResult r = test::run_process(argv, {{"OMP_NUM_THREADS", "1"}});
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find(says), std::string::npos) << r.output;
  };
  nlohmann::json five = test::qwen3_moe_config();
  five["num_experts"] = 5;
  refused(with({"--model.flavor", five.dump(), "--training.local_batch_size", "4"}, ep(2)),
          "does not divide the model's 5 routed experts");
  refused(with({"--training.local_batch_size", "4"}, ep(2)), "needs a mixture-of-experts model");  // dense Qwen3
  refused(with(with(moe, {"--training.local_batch_size", "4", "--parallelism.expert_tensor_parallel_degree", "2"}), ep(2)),
          "expert_tensor_parallel_degree 2 is not supported");
}

TEST(ModelFamiliesTrain, AHuggingFaceQwen3MoeContinuesPretrainingUnderExpertParallelismAndExportsBack) {
  // transformers' Qwen3MoeForCausalLM (random, saved one tensor per expert) trained from its weights
  // with its experts split over 2 ranks, as one process trains it; the last save, in Hugging Face's
  // format, holds the trained weights one tensor per expert.
  test::TempDir dir;
  nlohmann::json config = test::qwen3_moe_config();
  std::ofstream(dir / "create.json") << config.dump();
  safetensors::save(dir / "tokens.safetensors", {{"tokens", at::zeros({1, 4}, at::kLong)}});
  auto r = test::run_process({test::python(), kSource + "/tests/reference/hf_reference.py", "create",
                              dir / "create.json", dir / "hf", dir / "tokens.safetensors", dir / "out.safetensors"},
                             {{"OMP_NUM_THREADS", "2"}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<std::string> hf = {"--model.flavor", dir / "hf/config.json", "--checkpoint.initial_load_path",
                                       dir / "hf", "--checkpoint.initial_load_in_hf"};
  const safetensors::Tensors ref = expect_layouts_train_as_one_process(
      "qwen3_debugmodel.toml", hf,
      {{"ep2", {"--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"}}});
  ASSERT_FALSE(ref.empty());
  // The weights were loaded: the same model from a random initialization starts elsewhere.
  test::TempDir own;
  const test::LaunchedRun fresh =
      test::run_titan(1, train_args("qwen3_debugmodel.toml", own.path(), {"--model.flavor", dir / "hf/config.json"}), own);
  ASSERT_EQ(fresh.exit_code, 0) << fresh.output;
  EXPECT_GT(std::abs(fresh.weights.at("__losses__")[0].item<double>() - ref.at("__losses__")[0].item<double>()), 1e-3);

  test::TempDir export_dir;
  std::vector<std::string> export_hf = hf;
  export_hf.insert(export_hf.end(), {"--checkpoint.enable", "--checkpoint.last_save_model_only",
                                     "--checkpoint.last_save_in_hf", "--training.local_batch_size", "4",
                                     "--parallelism.expert_parallel_degree", "2"});
  const test::LaunchedRun exported =
      test::run_titan(2, train_args("qwen3_debugmodel.toml", export_dir.path(), export_hf), export_dir, kOrderMatched);
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  EXPECT_NE(exported.output.find("holds no routing biases (2 MoE layers): they start at zero"), std::string::npos)
      << exported.output;
  const std::string step_dir = export_dir / "checkpoint/step-10";
  StateDict trained;
  for (const auto& [name, t] : exported.weights)
    if (name != "__losses__") trained[name] = t;
  const StateDict expected = model_spec("qwen3").hf_adapter(dir / "hf/config.json").to_hf(trained);
  const auto stored = safetensors::load(step_dir + "/model.safetensors").tensors;
  ASSERT_EQ(stored.size(), expected.size());
  EXPECT_TRUE(stored.count("model.layers.2.mlp.experts.7.down_proj.weight"));
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(stored.count(name)) << name;
    EXPECT_TRUE(at::equal(stored.at(name), t)) << name;
  }
}

TEST(ModelFamiliesTrain, Qwen3MoeWithTheAuxiliaryLossTrainsAsOneProcess) {
  // The auxiliary load-balancing loss of each forward counts the routed copies of every rank that
  // holds other tokens of the micro-batch (data, context and expert parallel, tensor parallel under
  // sequence parallelism): each layout's losses, weights and logged auxiliary loss equal one process's
  // (a rank that balanced its own tokens only would train differently). Each micro-batch balances its
  // own tokens: 8 pipeline micro-batches train as one process accumulating 8 micro-batches.
  // The coefficient is large so that the loss's gradient shows in every weight.
  const std::vector<std::string> aux = {"--model.flavor", test::qwen3_moe_config().dump(), "--model.moe_aux_loss_coeff", "0.5"};
  const std::vector<Layout> runs = {
      {"fsdp2", {"--training.local_batch_size", "4"}},
      {"ep2_tp2", {"--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4",
                   "--parallelism.expert_parallel_degree", "2"}, 4},
      {"cp2", {"--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"}},
      // Without sequence parallelism both tp ranks route every token: their counts are not summed.
      {"tp2_without_sequence_parallel",
       {"--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "false"}},
      {"hsdp_ep2_full_ac", {"--parallelism.data_parallel_replicate_degree", "2", "--training.local_batch_size", "2",
                            "--activation_checkpoint.mode", "full", "--parallelism.expert_parallel_degree", "2"}, 4},
  };
  std::string output;
  std::vector<double> figures;
  const safetensors::Tensors ref = expect_layouts_train_as_one_process("qwen3_debugmodel.toml", aux, runs, &output, &figures);
  ASSERT_FALSE(ref.empty());
  std::vector<std::string> accumulating = aux;
  accumulating.insert(accumulating.end(), {"--training.local_batch_size", "1"});
  expect_layouts_train_as_one_process(
      "qwen3_debugmodel.toml", accumulating,
      {{"pp2", {"--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                "--training.local_batch_size", "8"}}});
  // The logged auxiliary loss is K = 2 for perfectly balanced routing and grows with imbalance: the
  // layers' mean of E sum_e f_e P_e, between 1 and E = 8 here.
  ASSERT_EQ(figures.size(), 9u);  // steps 1, 5 and 10: imbalance, its max, the auxiliary loss
  for (size_t i = 2; i < figures.size(); i += 3) {
    EXPECT_GT(figures[i], 1.0);
    EXPECT_LT(figures[i], 8.0);
  }
  EXPECT_NE(output.find("moe_aux_loss: "), std::string::npos) << output;
  // On a dense model the option is refused.
  test::TempDir dense;
  std::vector<std::string> argv = {std::string(TITAN_BINARY_DIR) + "/titan"};
  for (const auto& a : train_args("qwen3_debugmodel.toml", dense.path(), {"--model.moe_aux_loss_coeff", "0.01"}))
    argv.push_back(a);
  const test::ProcessResult refused = test::run_process(argv, {{"OMP_NUM_THREADS", "1"}});
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("has no MoE layers"), std::string::npos) << refused.output;
}

TEST(ModelFamiliesTrain, DeepseekV3UnderEveryLayoutItSupports) {
  // A small DeepSeek-V3 (multi-head latent attention with a query latent and YaRN, a dense first
  // layer, then two MoE layers of 8 experts with a shared expert and sigmoid group-limited routing)
  // from its config.json text: FSDP, TP (MLA's heads split, its latents replicated; sequence parallel
  // and not; async), CP (ring attention over MLA's heads, v padded), PP, EP and full activation
  // checkpointing train as one process.
  const nlohmann::json config = {
      {"model_type", "deepseek_v3"}, {"hidden_size", 64},      {"intermediate_size", 96},
      {"moe_intermediate_size", 32}, {"num_hidden_layers", 3}, {"first_k_dense_replace", 1},
      {"num_attention_heads", 4},    {"num_key_value_heads", 4}, {"n_routed_experts", 8},
      {"n_shared_experts", 1},       {"num_experts_per_tok", 2}, {"n_group", 2},
      {"topk_group", 1},             {"norm_topk_prob", true},  {"routed_scaling_factor", 2.5},
      {"q_lora_rank", 16},           {"kv_lora_rank", 32},      {"qk_nope_head_dim", 16},
      {"qk_rope_head_dim", 8},       {"v_head_dim", 12},        {"vocab_size", 2048},
      {"rms_norm_eps", 1e-6},        {"rope_theta", 10000.0},   {"max_position_embeddings", 163840},
      {"tie_word_embeddings", false},
      {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 40.0}, {"original_max_position_embeddings", 4096},
                        {"beta_fast", 32.0}, {"beta_slow", 1.0}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}}}};
  const std::vector<std::string> ds = {"--model.flavor", config.dump()};
  std::vector<Layout> runs = layouts();
  runs.push_back({"tp2_without_sequence_parallel",
                  {"--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "false"}});
  runs.push_back({"tp2_async", {"--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel"}});
  runs.push_back({"pp2", {"--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"}});
  runs.push_back({"ep2", {"--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"}});
  runs.push_back({"full_ac", {"--activation_checkpoint.mode", "full"}, 1});
  const safetensors::Tensors ref = expect_layouts_train_as_one_process("deepseek_v3_debugmodel.toml", ds, runs);
  ASSERT_FALSE(ref.empty());
  EXPECT_TRUE(ref.count("layers.1.attention.wkv_b.weight"));
}

// A Llama with biases (attention_bias and mlp_bias, from its config.json): the column-wise split
// layers hold their rows' biases, the row-wise ones (wo, w2) the whole bias, added once after the
// reduction (its gradient summed over tp under sequence parallelism).
TEST(ModelFamiliesTrain, LlamaWithBiasesUnderEveryLayout) {
  const nlohmann::json config = {{"model_type", "llama"},    {"hidden_size", 64},      {"intermediate_size", 96},
                                 {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"num_hidden_layers", 2},
                                 {"vocab_size", 2048},       {"rms_norm_eps", 1e-5},   {"rope_theta", 10000.0},
                                 {"attention_bias", true},   {"mlp_bias", true},       {"tie_word_embeddings", false}};
  std::vector<Layout> runs = layouts();
  runs.push_back({"tp2_without_sequence_parallel",
                  {"--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_sequence_parallel", "false"}});
  runs.push_back({"tp2_async", {"--parallelism.tensor_parallel_degree", "2", "--parallelism.enable_async_tensor_parallel"}});
  runs.push_back({"pp2", {"--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"}});
  runs.push_back({"tp2_fsdp2_full_ac", {"--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4",
                                        "--activation_checkpoint.mode", "full"}, 4});
  runs.push_back({"ddp2", {"--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                           "1", "--training.local_batch_size", "4"}});
  const safetensors::Tensors ref =
      expect_layouts_train_as_one_process("llama2_debugmodel.toml", {"--model.flavor", config.dump()}, runs);
  ASSERT_FALSE(ref.empty());
  // The biases trained (initialized to zeros; each moved).
  for (const char* name : {"layers.1.attention.wo.bias", "layers.1.attention.wq.bias", "layers.1.feed_forward.w2.bias"}) {
    ASSERT_TRUE(ref.count(name)) << name;
    EXPECT_GT(ref.at(name).abs().max().item<double>(), 0.0) << name;
  }
}

TEST(ModelFamiliesTrain, Llama2DebugModelUnderEveryLayout) {
  std::vector<Layout> runs = layouts();
  runs[0].args.push_back("--training.enable_cpu_offload");
  runs.push_back({"pp2", {"--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"}});
  expect_layouts_train_as_one_process("llama2_debugmodel.toml", {}, runs);
}

}  // namespace
}  // namespace titan
