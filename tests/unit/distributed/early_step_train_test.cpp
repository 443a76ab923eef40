// optimizer.early_step_in_backward: every parameter is updated inside the backward as soon as its
// gradient is final, and the gradient freed. Without clipping (max_norm 1e9 here: the usual step
// then clips nothing either) the update is AdamW's on the same gradients, so each layout trains
// bit for bit as its usual step does: same losses, same logged gradient norms, same final weights,
// the same collectives (bytes per step, per group and operation), and no host read outside log
// steps (run_titan checks it). The layouts cover every place a gradient becomes final: autograd's
// accumulation (one process, tensor parallel alone), FSDP's reduce-scatter (with gradient
// accumulation, CPU offload, context parallel), HSDP's all-reduce over replicas, DDP's buckets, and
// sequence parallel's partial sums, added over the tp group after backward.
// In one process: the measured peak memory falls by most of the gradients, and a non-finite loss
// under nan_policy stop leaves the model as it was before that step (non-finite gradients under a
// finite loss skip only the updates they feed: docs/memory.md).
#include "launched_training.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/common/memory_tracker.h"
#include "titan/config/job_config.h"
#include "titan/trainer/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <regex>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;

std::vector<std::string> train_args(const test::TempDir& dir, int local_batch, std::vector<std::string> extra,
                                    const std::string& config = "llama3_debugmodel") {
  std::vector<std::string> a = {"train", "--job.config_file", kSource + "/configs/" + config + ".toml",
                                "--model.hf_assets_path", kSource + "/assets/tokenizer",
                                "--job.dump_folder", dir.path(), "--training.seq_len", "32",
                                "--training.local_batch_size", std::to_string(local_batch),
                                "--training.global_batch_size", "8", "--training.steps", "8",
                                "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
                                "--training.max_norm", "1e9"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

std::vector<std::string> grad_norms(const std::string& output) {
  static const std::regex norm(R"(step:\s*\d+\s+loss:\s*[\d.]+\s+grad_norm:\s*([\d.]+))");
  std::vector<std::string> out;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), norm); it != std::sregex_iterator(); ++it)
    out.push_back((*it)[1]);
  return out;
}

// The layout trained with the usual step and with early_step_in_backward: bitwise the same.
void expect_early_step_changes_nothing(int nproc, int local_batch, const std::vector<std::string>& layout,
                                       const std::string& config = "llama3_debugmodel") {
  test::TempDir usual_dir, early_dir;
  std::vector<std::string> early_layout = layout;
  early_layout.push_back("--optimizer.early_step_in_backward");
  const test::LaunchedRun usual = test::run_titan(nproc, train_args(usual_dir, local_batch, layout, config), usual_dir);
  const test::LaunchedRun early =
      test::run_titan(nproc, train_args(early_dir, local_batch, early_layout, config), early_dir);
  ASSERT_EQ(usual.exit_code, 0);
  ASSERT_EQ(early.exit_code, 0);
  EXPECT_NE(early.output.find("optimizer.early_step_in_backward: every parameter is updated inside the backward"),
            std::string::npos)
      << early.output;
  ASSERT_EQ(usual.weights.size(), early.weights.size());
  for (const auto& [name, t] : usual.weights) {
    ASSERT_TRUE(early.weights.count(name)) << name;
    EXPECT_TRUE(at::equal(early.weights.at(name), t)) << name << ": max difference "
                                                       << (early.weights.at(name) - t).abs().max().item<double>();
  }
  const std::vector<std::string> usual_norms = grad_norms(usual.output), early_norms = grad_norms(early.output);
  EXPECT_EQ(usual_norms.size(), 8u);  // rank 0 logs every step
  EXPECT_EQ(early_norms, usual_norms);
  ASSERT_EQ(usual.comm.size(), early.comm.size());
  for (size_t r = 0; r < usual.comm.size(); ++r) EXPECT_EQ(early.comm[r].at("bytes"), usual.comm[r].at("bytes")) << "rank " << r;
}

TEST(EarlyStepInBackward, OneProcessWithGradientAccumulation) { expect_early_step_changes_nothing(1, 4, {}); }
TEST(EarlyStepInBackward, Fsdp2WithGradientAccumulation) { expect_early_step_changes_nothing(2, 2, {}); }
TEST(EarlyStepInBackward, Hsdp2x2) {
  expect_early_step_changes_nothing(4, 2, {"--parallelism.data_parallel_replicate_degree", "2"});
}
// Qwen3's debug model: tied embeddings, and six DDP buckets whose gradients arrive interleaved (a
// layer's norms after its matmuls).
TEST(EarlyStepInBackward, Ddp2WithSeveralBuckets) {
  expect_early_step_changes_nothing(2, 4, {"--parallelism.data_parallel_replicate_degree", "2",
                                           "--parallelism.data_parallel_shard_degree", "1"},
                                    "qwen3_debugmodel");
}
TEST(EarlyStepInBackward, Tp2WithSequenceParallel) {
  expect_early_step_changes_nothing(2, 8, {"--parallelism.tensor_parallel_degree", "2"}, "qwen3_debugmodel");
}
TEST(EarlyStepInBackward, Tp2xFsdp2) {
  expect_early_step_changes_nothing(4, 4, {"--parallelism.tensor_parallel_degree", "2"});
}
TEST(EarlyStepInBackward, CpuOffloadFsdp2) {
  expect_early_step_changes_nothing(2, 4, {"--training.enable_cpu_offload"});
}
TEST(EarlyStepInBackward, Cp2) { expect_early_step_changes_nothing(2, 8, {"--parallelism.context_parallel_degree", "2"}); }

JobConfig one_process(const test::TempDir& dir, std::vector<std::string> extra) {
  std::vector<std::string> a = train_args(dir, 8, std::move(extra));
  a.erase(a.begin());  // "train"
  a.insert(a.end(), {"--model.hf_assets_path", kSource + "/assets/tokenizer", "--metrics.log_freq", "100",
                     "--lr_scheduler.total_steps", "8"});
  return parse_config(a);
}

// The peak of a training step's tensor memory (the counting allocator's, above what was allocated
// before the trainer was built), measured in this process on the second step (the first creates
// AdamW's state), with 8 tokens per step so that the parameters dominate: the usual step holds every
// gradient at the end of backward (and until the next step's zero_grad), the early one a few
// parameters' at a time. The saving is at least 3/4 of the gradients' bytes.
TEST(EarlyStepInBackward, OneProcessPeakFallsByMostOfTheGradients) {
  mem::install_cpu_tracking();
  auto peak = [](bool early) {
    test::TempDir dir;
    std::vector<std::string> extra = {"--training.seq_len", "8", "--training.global_batch_size", "1",
                                      "--training.local_batch_size", "1"};
    if (early) extra.push_back("--optimizer.early_step_in_backward");
    const int64_t base = mem::cpu_allocated_bytes();
    Trainer t(one_process(dir, extra));
    t.train_step();
    mem::reset_cpu_peak();
    t.train_step();
    return mem::cpu_peak_bytes() - base;
  };
  const int64_t usual = peak(false), early = peak(true);
  int64_t grads = 0;  // fp32, one per parameter
  {
    test::TempDir dir;
    Trainer t(one_process(dir, {}));
    for (const auto& p : t.parameters()) grads += p.local.numel() * 4;
  }
  std::printf("step peak: usual %lld B, early %lld B; gradients %lld B\n", (long long)usual, (long long)early,
              (long long)grads);
  EXPECT_GE(usual - early, grads * 3 / 4);
}

// The full weights after `steps` uninterrupted steps with the option, in one process.
std::map<std::string, at::Tensor> early_step_weights_after(int steps) {
  test::TempDir dir;
  Trainer t(one_process(dir, {"--optimizer.early_step_in_backward", "--training.steps", std::to_string(steps)}));
  t.train();
  return t.full_parameters();
}

// nan_policy stop: the step whose loss is NaN updates nothing (each update is skipped on the
// device), nor does any later one, and the run ends at the next read (here the last step, 6) with
// the model of the step before.
TEST(EarlyStepInBackward, ANonFiniteLossUpdatesNothingAndStops) {
  const std::map<std::string, at::Tensor> before = early_step_weights_after(3);
  test::TempDir dir;
  ::setenv("TITAN_FAULT_INJECT", "action=nan,step=4", 1);
  Trainer t(one_process(dir, {"--optimizer.early_step_in_backward", "--training.steps", "6"}));
  try {
    t.train();
    ADD_FAILURE() << "training went on after a NaN loss";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("step 4: the loss is nan"), std::string::npos) << e.what();
  }
  ::unsetenv("TITAN_FAULT_INJECT");
  EXPECT_EQ(t.step(), 6);  // steps 5 and 6 ran (and updated nothing) before the last step's read
  const std::map<std::string, at::Tensor> after = t.full_parameters();
  ASSERT_EQ(after.size(), before.size());
  for (const auto& [name, w] : before) EXPECT_TRUE(at::equal(after.at(name), w)) << name;
}

// The optimizer state is the usual one: a run saved at step 2 with the option resumes with or without
// it into exactly the weights of 4 uninterrupted steps (no clipping on either side).
TEST(EarlyStepInBackward, ACheckpointResumesTheSameWithAndWithoutIt) {
  const std::map<std::string, at::Tensor> straight = early_step_weights_after(4);
  for (const bool early_after : {true, false}) {
    SCOPED_TRACE(early_after ? "resumed with it" : "resumed without it");
    test::TempDir dir;
    const std::vector<std::string> save = {"--checkpoint.enable", "--checkpoint.interval", "2",
                                           "--checkpoint.last_save_model_only", "false"};
    {
      std::vector<std::string> a = save;
      a.insert(a.end(), {"--optimizer.early_step_in_backward", "--training.steps", "2"});
      Trainer t(one_process(dir, a));
      t.train();
      t.wait_for_checkpoint();
    }
    std::vector<std::string> a = save;
    a.insert(a.end(), {"--training.steps", "4"});
    if (early_after) a.push_back("--optimizer.early_step_in_backward");
    Trainer t(one_process(dir, a));
    EXPECT_EQ(t.step(), 2);  // resumed
    t.train();
    const std::map<std::string, at::Tensor> resumed = t.full_parameters();
    ASSERT_EQ(resumed.size(), straight.size());
    for (const auto& [name, w] : straight) EXPECT_TRUE(at::equal(resumed.at(name), w)) << name;
  }
}

TEST(EarlyStepInBackward, WhatCannotStepInBackwardIsAClearError) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--training.nan_policy", "skip"}, "use nan_policy = \"stop\""},
      {{"--parallelism.pipeline_parallel_degree", "2"}, "parallelism.pipeline_parallel_degree = 2"},
      {{"--parallelism.expert_parallel_degree", "2"}, "parallelism.expert_parallel_degree = 2"},
  };
  for (const auto& [args, expected] : cases) {
    std::vector<std::string> a = {"--optimizer.early_step_in_backward"};
    a.insert(a.end(), args.begin(), args.end());
    try {
      parse_config(a);
      ADD_FAILURE() << "accepted " << args[0];
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("optimizer.early_step_in_backward"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace titan
