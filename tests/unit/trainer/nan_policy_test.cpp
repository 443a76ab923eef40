// training.nan_policy: a step whose loss (or gradient norm) is not finite never updates the model.
// stop (default) ends the run with an error naming that step, the last checkpoint intact and
// nothing saved after it; skip goes on with the next batch. The host reads the flag at log, save and
// validation steps only: under stop no update follows the bad step, and the run ends at the next read. The NaN is injected into one rank's loss
// (TITAN_FAULT_INJECT action=nan), so the detection runs on the real path.
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/checkpoint.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/config/job_config.h"
#include "titan/trainer/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <regex>
#include <sstream>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";

std::vector<std::string> args(const std::string& dump, int steps, std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {
      "--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder", dump,
      "--model.hf_assets_path", kSource + "/assets/tokenizer", "--training.seq_len", "32",
      "--training.local_batch_size", "4", "--training.steps", std::to_string(steps), "--lr_scheduler.warmup_steps",
      "2", "--lr_scheduler.total_steps", "8", "--metrics.log_freq", "100"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// Sets TITAN_FAULT_INJECT for the lifetime of the object.
struct Faults {
  explicit Faults(const std::string& spec) { ::setenv("TITAN_FAULT_INJECT", spec.c_str(), 1); }
  ~Faults() { ::unsetenv("TITAN_FAULT_INJECT"); }
};

std::map<std::string, at::Tensor> weights_after(int steps, const std::vector<std::string>& extra = {}) {
  test::TempDir dir;
  Trainer t(parse_config(args(dir.path(), steps, extra)));
  t.train();
  return t.full_parameters();
}

void expect_equal(const std::map<std::string, at::Tensor>& a, const std::map<std::string, at::Tensor>& b,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) EXPECT_TRUE(at::equal(t, b.at(name))) << what << ": " << name;
}

TEST(NanPolicy, StopEndsTheRunAtThatStepWithTheLastCheckpointIntact) {
  for (const std::string async : {"disabled", "async"}) {
    SCOPED_TRACE(async);
    test::TempDir dir;
    Faults faults("action=nan,step=5");
    Trainer t(parse_config(args(dir.path(), 8,
                                {"--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.async_mode", async})));
    try {
      t.train();
      ADD_FAILURE() << "training went on after a NaN loss";
    } catch (const UserError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("step 5: the loss is nan and the gradient norm nan (not finite), so the model was not updated"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("training.nan_policy = stop"), std::string::npos) << msg;
      EXPECT_NE(msg.find("the last checkpoint (step 4, " + dir.path() + "/checkpoint/step-4) is intact"),
                std::string::npos)
          << msg;
    }
    EXPECT_EQ(t.step(), 6);  // the next save step, where the host reads the results of steps 5 and 6
    auto saved = checkpoint::list_checkpoints(dir / "checkpoint");
    ASSERT_FALSE(saved.empty());
    EXPECT_EQ(saved.rbegin()->first, 4);
    // The bad step changed nothing: the model is the one after step 4.
    expect_equal(t.full_parameters(), weights_after(4), "after the stop");
  }
}

TEST(NanPolicy, SkipLeavesTheModelUnchangedAndGoesOn) {
  for (const std::string impl : {"fused", "for-loop"}) {
    SCOPED_TRACE(impl);
    const std::vector<std::string> opt = {"--optimizer.implementation", impl};
    test::TempDir dir;
    Faults faults("action=nan,step=3");
    auto extra = opt;
    extra.insert(extra.end(), {"--training.nan_policy", "skip"});
    Trainer t(parse_config(args(dir.path(), 3, extra)));
    std::vector<double> losses = t.train();
    ASSERT_EQ(losses.size(), 3u);
    EXPECT_TRUE(std::isfinite(losses[0]) && std::isfinite(losses[1]));
    EXPECT_TRUE(std::isnan(losses[2]));
    // Parameters are those after step 2 (moments and step counts: SkippedStepKeepsTheOptimizerState).
    expect_equal(t.full_parameters(), weights_after(2, opt), "after the skipped step");
    // And training goes on with finite losses.
    t.train_step();
    StepResult r = t.train_step();
    EXPECT_TRUE(std::isfinite(r.loss) && !r.skipped);
  }
}

TEST(NanPolicy, SkippedStepKeepsTheOptimizerState) {
  test::TempDir dir;
  Faults faults("action=nan,step=2");
  Trainer t(parse_config(args(dir.path(), 1, {"--training.nan_policy", "skip", "--checkpoint.enable",
                                               "--checkpoint.interval", "1", "--checkpoint.last_save_model_only",
                                               "false"})));
  t.train();  // step 1 (saved)
  StepResult r = t.train_step();  // step 2: NaN
  EXPECT_TRUE(r.skipped);
  t.save_checkpoint(/*model_only=*/false);
  t.wait_for_checkpoint();
  checkpoint::Reader one(dir / "checkpoint/step-1"), two(dir / "checkpoint/step-2");
  int compared = 0;
  for (const auto& name : one.names()) {
    if (name.rfind("model.", 0) != 0 && name.rfind("optimizer.", 0) != 0) continue;
    const auto shape = one.meta(name)->shape;
    const std::vector<int64_t> begin(shape.size(), 0);
    EXPECT_TRUE(at::equal(one.read(name, begin, shape), two.read(name, begin, shape))) << name;
    ++compared;
  }
  EXPECT_GT(compared, 20);
}

// Under FSDP 2 a NaN on one rank skips the update on both (the gradient norm is global): the final
// weights equal one process that skipped the same step (same global batch), which a rank that
// updated its shard alone would not.
TEST(NanPolicy, SkipUnderFsdpSkipsOnEveryRank) {
  test::TempDir dir;
  std::vector<std::string> argv = {kTitan, "launch", "--nproc-per-node", "2", "--master-port", "0", "--", "train"};
  auto a = args(dir.path(), 4, {"--training.nan_policy", "skip", "--metrics.log_freq", "1"});
  argv.insert(argv.end(), a.begin(), a.end());
  const std::string weights = dir / "weights.safetensors";
  auto r = test::run_process(argv, {{"TITAN_FAULT_INJECT", "action=nan,step=2,rank=1"},
                                    {"TITAN_DEBUG_DUMP_WEIGHTS", weights}}, std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("WARNING - step 2: the loss is nan"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("1 step(s) skipped so far"), std::string::npos) << r.output;
  auto fsdp = safetensors::load(weights).tensors;
  test::TempDir one_dir;
  std::map<std::string, at::Tensor> one;
  {
    Faults faults("action=nan,step=2");
    Trainer t(parse_config(args(one_dir.path(), 4, {"--training.nan_policy", "skip", "--training.local_batch_size", "8"})));
    t.train();
    one = t.full_parameters();
  }
  ASSERT_EQ(fsdp.size(), one.size() + 1);  // and __losses__
  // FSDP and one process differ by summation order (~5e-5 after Adam's first steps); one Adam step
  // taken by one rank alone moves its shard by ~lr (8e-4) per element, ~1e-2 of the largest weight.
  for (const auto& [name, t] : one) EXPECT_LT(test::relative_error(fsdp.at(name), t), 1e-3) << name;
}

// Under the launcher with restarts, a stop is final: exit code 65 and no restart, since the resumed
// job would reach the same step again.
TEST(NanPolicy, StopIsNotRestarted) {
  test::TempDir dir;
  std::vector<std::string> argv = {kTitan, "launch", "--nproc-per-node", "2", "--master-port", "0",
                                   "--max-restarts", "2", "--", "train"};
  auto a = args(dir.path(), 4, {"--checkpoint.enable", "--checkpoint.interval", "1"});
  argv.insert(argv.end(), a.begin(), a.end());
  auto r = test::run_process(argv, {{"TITAN_FAULT_INJECT", "action=nan,step=3,rank=0,attempt=any"}},
                             std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 65) << r.output;
  EXPECT_NE(r.output.find("not restarting: the job stopped itself"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("restarting all workers"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("step 3: the loss is nan"), std::string::npos) << r.output;
}

TEST(NanPolicy, DefaultIsStopAndValuesAreChecked) {
  EXPECT_EQ(JobConfig().training.nan_policy, "stop");
  try {
    parse_config({"--training.nan_policy", "ignore"});
    ADD_FAILURE() << "accepted nan_policy ignore";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("nan_policy"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace titan

namespace titan {
namespace {

TEST(NanPolicy, SkippedStepLeavesTheRoutingBiasesAlone) {
  // A small Qwen3-MoE: the bias update that follows each optimizer step is skipped with it; the next
  // finite step moves the biases again.
  const std::string moe = R"({"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 96,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 2048,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": true})";
  test::TempDir dir;
  Faults faults("action=nan,step=2");
  Trainer t(parse_config(args(dir.path(), 1,
                              {"--job.config_file", kSource + "/configs/qwen3_debugmodel.toml", "--model.flavor", moe,
                               "--training.nan_policy", "skip", "--checkpoint.enable", "--checkpoint.interval", "1"})));
  t.train();  // step 1 (saved)
  EXPECT_TRUE(t.train_step().skipped);  // step 2: NaN
  t.save_checkpoint(/*model_only=*/true);
  EXPECT_FALSE(t.train_step().skipped);  // step 3
  t.save_checkpoint(/*model_only=*/true);
  t.wait_for_checkpoint();
  checkpoint::Reader one(dir / "checkpoint/step-1"), two(dir / "checkpoint/step-2"), three(dir / "checkpoint/step-3");
  for (const std::string layer : {"0", "1"}) {
    const std::string name = "model.layers." + layer + ".moe.expert_bias";
    ASSERT_TRUE(one.meta(name).has_value()) << name;
    const at::Tensor b1 = one.read(name, {0}, {8}), b2 = two.read(name, {0}, {8}), b3 = three.read(name, {0}, {8});
    EXPECT_GT(b1.abs().max().item<double>(), 0.0) << name;  // step 1 moved them
    EXPECT_TRUE(at::equal(b1, b2)) << name << b1 << b2;     // the skipped step did not
    EXPECT_FALSE(at::equal(b2, b3)) << name;                // step 3 did
  }
}

}  // namespace
}  // namespace titan
