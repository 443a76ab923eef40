// Context parallelism through the real launcher equals the single-process run.
//
// Each layout trains the debug model (6 blocks, dim 256) for 10 steps on the bundled corpus with the
// same global batch as one process training alone; per-step losses must agree within 1e-5
// relative and the final weights (gathered by TITAN_DEBUG_DUMP_WEIGHTS) within 1% of lr x steps,
// as in launch_train_test.cpp. Validation runs at steps 1, 5 and 10 in both, and its losses agree
// too (titan report --check). Gradient clipping is active (max_norm 1), so the norm summed over the
// sequence's parts is checked along with the loss.
#include "launched_training.h"
#include "test_util.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";
constexpr int kSteps = 10;
constexpr double kLr = 8e-4;

std::vector<std::string> train_args(const std::string& dump, int seq, int global_batch, int local_batch,
                                    std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {
      "train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder", dump,
      "--training.seq_len", std::to_string(seq), "--training.local_batch_size", std::to_string(local_batch),
      "--training.global_batch_size", std::to_string(global_batch), "--training.steps", std::to_string(kSteps),
      "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "5", "--validation.enable", "--validation.dataset", "c4_test", "--validation.freq", "5",
      "--validation.steps", "2", "--validation.seq_len", std::to_string(seq), "--validation.local_batch_size", "2"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// One process, whole sequences: the reference of every layout with this sequence length and batch.
struct Reference {
  test::TempDir dir;
  safetensors::Tensors weights;
};
const Reference& single_process(int seq, int global_batch) {
  static std::map<std::pair<int, int>, std::unique_ptr<Reference>> cache;
  auto& ref = cache[{seq, global_batch}];
  if (!ref) {
    ref = std::make_unique<Reference>();
    ref->weights = test::run_titan(1, train_args(ref->dir.path(), seq, global_batch, global_batch), ref->dir).weights;
  }
  return *ref;
}

// Trains `layout` in nproc processes and compares it with one process (losses, weights, validation).
test::LaunchedRun expect_same_as_one_process(int nproc, int seq, int global_batch, int local_batch,
                                             const std::vector<std::string>& layout) {
  const Reference& ref = single_process(seq, global_batch);
  test::TempDir dir;
  test::LaunchedRun r = test::run_titan(nproc, train_args(dir.path(), seq, global_batch, local_batch, layout), dir);
  test::expect_same_training(ref.weights, r.weights, 0.01 * kLr * kSteps);
  auto check = test::run_process({kTitan, "report", "--check", ref.dir.path(), dir.path(), "--metric", "validation_loss"},
                                 {}, std::chrono::seconds(60));
  EXPECT_EQ(check.exit_code, 0) << check.output;
  return r;
}

std::vector<std::string> cp_layout(int cp, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--parallelism.context_parallel_degree", std::to_string(cp)};
  bool shard_set = false;
  for (const auto& a : extra) shard_set = shard_set || a == "--parallelism.data_parallel_shard_degree";
  if (!shard_set) args.insert(args.end(), {"--parallelism.data_parallel_shard_degree", "1"});
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// What one step moves on the cp dimension with the default all-gather: per block, forward
// all-gathers every rank's K and V, backward gathers them again and reduce-scatters their fp32
// gradients. The debug model: 6 blocks, 16 key/value heads of 16, so the K/V gradients of the whole
// sequence are 2 x B x 16 x S x 16 x 4 bytes per block (validation moves no gradients).
TEST(ContextParallelTrain, Cp2AtSequenceLength1024) {
  test::LaunchedRun r = expect_same_as_one_process(2, 1024, 2, 2, cp_layout(2));
  EXPECT_NE(r.output.find("CP: ring attention, headtail load balancing, K/V by allgather"), std::string::npos) << r.output;
  const int64_t kv_grads = 6 * int64_t{2} * 2 * 16 * 1024 * 16 * 4;
  for (const auto& rank : r.comm) {
    EXPECT_EQ(test::comm_bytes_per_step(rank, "cp", "reduce_scatter"), kv_grads);
    EXPECT_GE(test::comm_bytes_per_step(rank, "cp", "all_gather"), 2 * kv_grads);  // and validation's forwards
  }
}

TEST(ContextParallelTrain, Cp4) { expect_same_as_one_process(4, 256, 4, 4, cp_layout(4)); }

TEST(ContextParallelTrain, Cp2RingWithoutLoadBalancing) {
  test::LaunchedRun r = expect_same_as_one_process(
      2, 256, 4, 4,
      cp_layout(2, {"--parallelism.context_parallel_rotate_method", "alltoall", "--parallelism.context_parallel_load_balancer",
                    "none"}));
  for (const auto& rank : r.comm) {
    EXPECT_GT(test::comm_bytes_per_step(rank, "cp", "all_to_all"), 0);
    EXPECT_EQ(test::comm_bytes_per_step(rank, "cp", "all_gather"), 0);
  }
}

// FSDP shards over dp_shard x cp (4 ranks); the batch splits over dp_shard only (the validation
// batch too: 1 sequence per data-parallel rank, the reference's 2 in all).
TEST(ContextParallelTrain, Cp2xFsdp2) {
  test::LaunchedRun r =
      expect_same_as_one_process(4, 256, 4, 2,
                                 cp_layout(2, {"--parallelism.data_parallel_shard_degree", "2",
                                               "--validation.local_batch_size", "1"}));
  for (const auto& rank : r.comm) EXPECT_GT(test::comm_bytes_per_step(rank, "dp_shard_cp", "reduce_scatter"), 0);
}

TEST(ContextParallelTrain, Cp2xTp2) {
  expect_same_as_one_process(4, 256, 4, 4, cp_layout(2, {"--parallelism.tensor_parallel_degree", "2"}));
}

TEST(ContextParallelTrain, Pp2xCp2) {
  expect_same_as_one_process(4, 256, 4, 4,
                             cp_layout(2, {"--parallelism.pipeline_parallel_degree", "2",
                                           "--parallelism.pipeline_parallel_schedule", "1F1B"}));
}

// A checkpoint saved under CP 2 x FSDP 2 resumes as FSDP 2 without CP, and steps 6-10 equal the
// uninterrupted run (cp holds no parameter shards of its own: FSDP's shards over dp_shard x cp reshard).
TEST(ContextParallelTrain, CheckpointFromCp2xFsdp2ResumesWithoutCp) {
  const Reference& ref = single_process(256, 4);
  test::TempDir save, resume;
  // 5 steps, then a save at step 5; the learning rate follows the 10-step schedule.
  auto first = cp_layout(2, {"--parallelism.data_parallel_shard_degree", "2", "--validation.local_batch_size", "1",
                             "--checkpoint.enable", "--checkpoint.interval", "5", "--training.steps", "5",
                             "--lr_scheduler.total_steps", "10"});
  test::LaunchedRun a = test::run_titan(4, train_args(save.path(), 256, 4, 2, first), save);
  ASSERT_EQ(a.exit_code, 0);
  test::expect_same_training(ref.weights, a.weights, 0);
  std::filesystem::copy(save / "checkpoint", resume / "checkpoint", std::filesystem::copy_options::recursive);
  test::LaunchedRun b = test::run_titan(
      2,
      train_args(resume.path(), 256, 4, 2,
                 {"--parallelism.data_parallel_shard_degree", "2", "--validation.local_batch_size", "1",
                  "--checkpoint.enable", "--checkpoint.interval", "100"}),
      resume);
  EXPECT_NE(b.output.find("continuing at step 6"), std::string::npos) << b.output;
  test::expect_same_training(ref.weights, b.weights, 0.01 * kLr * kSteps, /*first_step=*/6);
}

// Activation memory per rank falls as 1/cp: the bytes allocated in the forward phase and alive at
// the step's peak (each rank's CPU memory breakdown), at sequence length 1024.
TEST(ContextParallelTrain, ActivationMemoryPerRankScalesAsOneOverCp) {
  auto forward_bytes = [](int cp) {
    test::TempDir dir;
    auto args = train_args(dir.path(), 1024, 1, 1, {"--training.steps", "2", "--metrics.log_freq", "1",
                                                    "--profiling.enable_memory_snapshot", "--profiling.profile_freq", "2",
                                                    "--validation.enable=false"});
    if (cp > 1) {
      auto layout = cp_layout(cp);
      args.insert(args.end(), layout.begin(), layout.end());
    }
    test::LaunchedRun r = test::run_titan(cp, args, dir);
    int64_t most = 0;
    for (int rank = 0; rank < cp; ++rank) {
      std::ifstream f(dir / ("memory_snapshot/iteration_2/rank" + std::to_string(rank) + "_cpu_memory.json"));
      EXPECT_TRUE(f.good()) << r.output;
      if (!f.good()) return int64_t{0};
      most = std::max(most, nlohmann::json::parse(f).at("alive_by_phase").at("forward").get<int64_t>());
    }
    return most;
  };
  const int64_t one = forward_bytes(1), two = forward_bytes(2), four = forward_bytes(4);
  std::printf("forward activations alive at the peak, largest rank: cp 1 %.2f MB, cp 2 %.2f MB (x%.2f), "
              "cp 4 %.2f MB (x%.2f)\n", one / 1e6, two / 1e6, double(two) / one, four / 1e6, double(four) / one);
  ASSERT_GT(one, 0);
  EXPECT_LT(two, one * 0.55);
  EXPECT_GT(two, one * 0.45);  // a split of the sequence, not less work kept
  EXPECT_LT(four, one * 0.3);
}

// Bad input is an error at start-up that says what to change.
TEST(ContextParallelTrain, SequencesThatDoNotSplitAndUnsupportedBalancersAreClearErrors) {
  auto expect_error = [](std::vector<std::string> extra, const std::string& want) {
    test::TempDir dir;
    auto args = train_args(dir.path(), 102, 2, 2, cp_layout(2, extra));
    std::vector<std::string> argv = {kTitan, "launch", "--nproc-per-node", "2", "--master-port", "0", "--"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = test::run_process(argv, {{"OMP_NUM_THREADS", "1"}}, std::chrono::seconds(120));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find(want), std::string::npos) << r.output;
  };
  expect_error({}, "training.seq_len 102 is not divisible by 4 (2 x parallelism.context_parallel_degree 2)");
  expect_error({"--training.seq_len", "96", "--validation.seq_len", "90"}, "validation.seq_len 90 is not divisible by 4");
  expect_error({"--training.seq_len", "96", "--parallelism.context_parallel_load_balancer", "ptrr"},
               "\"ptrr\" balances per-document");
}

}  // namespace
}  // namespace titan
