// Data-parallel training through the real launcher (and torchrun) equals the single-process run.
//
// Each layout trains the debug model for 20 steps on the bundled corpus with the same global batch
// of 8 sequences; its per-step losses and final weights (written by TITAN_DEBUG_DUMP_WEIGHTS) are
// compared with one process training alone. Tolerances: losses 1e-5 relative at every step;
// final weights within 1% of lr x steps (AdamW moves every entry by about lr per step, so fp32
// rounding of near-zero gradient entries shows as absolute differences of a fraction of lr).
#include "test_util.h"

#include "titan/components/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <unistd.h>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";
constexpr int kSteps = 20;
constexpr double kLr = 8e-4;

std::vector<std::string> train_args(const std::string& dump, int local_batch) {
  return {"train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder", dump,
          "--training.seq_len", "32", "--training.local_batch_size", std::to_string(local_batch),
          "--training.global_batch_size", "8", "--training.steps", std::to_string(kSteps),
          "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "10"};
}

safetensors::Tensors run(const std::vector<std::string>& launcher, std::vector<std::string> args,
                         const test::TempDir& dir) {
  std::vector<std::string> argv = launcher;
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = test::run_process(argv, {{"TITAN_DEBUG_DUMP_WEIGHTS", dir / "weights.safetensors"}, {"OMP_NUM_THREADS", "1"}},
                             std::chrono::seconds(600));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (r.exit_code != 0) return {};
  return safetensors::load(dir / "weights.safetensors").tensors;
}

const safetensors::Tensors& single_process() {
  static test::TempDir dir;
  static safetensors::Tensors result = run({kTitan}, train_args(dir.path(), 8), dir);
  return result;
}

void expect_same_training(const safetensors::Tensors& got) {
  const auto& ref = single_process();
  ASSERT_FALSE(ref.empty());
  ASSERT_FALSE(got.empty());
  at::Tensor want = ref.at("__losses__"), have = got.at("__losses__");
  ASSERT_EQ(have.numel(), kSteps);
  for (int i = 0; i < kSteps; ++i)
    EXPECT_NEAR(have[i].item<double>(), want[i].item<double>(), 1e-5 * want[i].item<double>()) << "step " << i + 1;
  EXPECT_LT(have[kSteps - 1].item<double>(), have[0].item<double>());
  ASSERT_EQ(got.size(), ref.size());
  for (const auto& [name, t] : ref) {
    if (name == "__losses__") continue;
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_LE((got.at(name) - t).abs().max().item<double>(), 0.01 * kLr * kSteps) << name;
  }
}

std::vector<std::string> launch(int n) {
  return {kTitan, "launch", "--nproc-per-node", std::to_string(n), "--master-port", "0", "--"};
}

TEST(LaunchTrain, Fsdp2) {
  test::TempDir dir;
  expect_same_training(run(launch(2), train_args(dir.path(), 4), dir));
}

TEST(LaunchTrain, Fsdp4) {
  test::TempDir dir;
  expect_same_training(run(launch(4), train_args(dir.path(), 2), dir));
}

TEST(LaunchTrain, Hsdp2x2) {
  test::TempDir dir;
  auto args = train_args(dir.path(), 2);
  args.insert(args.end(), {"--parallelism.data_parallel_replicate_degree", "2"});
  expect_same_training(run(launch(4), args, dir));
}

TEST(LaunchTrain, Ddp2) {
  test::TempDir dir;
  auto args = train_args(dir.path(), 4);
  args.insert(args.end(), {"--parallelism.data_parallel_replicate_degree", "2",
                           "--parallelism.data_parallel_shard_degree", "1"});
  expect_same_training(run(launch(2), args, dir));
}

TEST(LaunchTrain, Fsdp2WithGradientAccumulation) {
  test::TempDir dir;  // local batch 2 x 2 ranks x 2 micro-batches = 8
  expect_same_training(run(launch(2), train_args(dir.path(), 2), dir));
}

// CPU offload: FSDP's shards, gradients and optimizer state in CPU memory (on a CPU run the compute
// device is the CPU too, so this checks the offload path's bookkeeping: the copies, the one-rank
// FSDP it uses without data parallelism, and the replica-only layout), with unchanged training.
TEST(LaunchTrain, CpuOffloadOneProcess) {
  test::TempDir dir;
  auto args = train_args(dir.path(), 8);
  args.push_back("--training.enable_cpu_offload");
  std::vector<std::string> titan = {kTitan};
  expect_same_training(run(titan, args, dir));
}

TEST(LaunchTrain, CpuOffloadFsdp2) {
  test::TempDir dir;
  auto args = train_args(dir.path(), 4);
  args.push_back("--training.enable_cpu_offload");
  expect_same_training(run(launch(2), args, dir));
}

TEST(LaunchTrain, CpuOffloadWithReplicasOnly) {
  test::TempDir dir;
  auto args = train_args(dir.path(), 4);
  args.insert(args.end(), {"--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree",
                           "1", "--training.enable_cpu_offload"});
  expect_same_training(run(launch(2), args, dir));
}

// Tensor parallelism (docs/parallelism.md): the debug model (16 heads, hidden 768, vocabulary 2048)
// over tp ranks, alone and inside FSDP or DDP, with each of its options.
std::vector<std::string> tp_args(const test::TempDir& dir, int tp, int local_batch, std::vector<std::string> extra = {}) {
  auto args = train_args(dir.path(), local_batch);
  args.insert(args.end(), {"--parallelism.tensor_parallel_degree", std::to_string(tp)});
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST(LaunchTrain, Tp2) {
  test::TempDir dir;
  expect_same_training(run(launch(2), tp_args(dir, 2, 8), dir));
}

TEST(LaunchTrain, Tp4) {
  test::TempDir dir;
  expect_same_training(run(launch(4), tp_args(dir, 4, 8), dir));
}

TEST(LaunchTrain, Tp2WithoutSequenceParallel) {
  test::TempDir dir;
  expect_same_training(run(launch(2), tp_args(dir, 2, 8, {"--parallelism.enable_sequence_parallel", "false"}), dir));
}

TEST(LaunchTrain, Tp2WithoutLossParallel) {
  test::TempDir dir;
  expect_same_training(run(launch(2), tp_args(dir, 2, 8, {"--parallelism.disable_loss_parallel"}), dir));
}

TEST(LaunchTrain, AsyncTp2) {
  test::TempDir dir;
  expect_same_training(run(launch(2), tp_args(dir, 2, 8, {"--parallelism.enable_async_tensor_parallel"}), dir));
}

TEST(LaunchTrain, Tp2xFsdp2) {
  test::TempDir dir;
  expect_same_training(run(launch(4), tp_args(dir, 2, 4), dir));
}

TEST(LaunchTrain, Tp2xDdp2WithGradientAccumulation) {
  test::TempDir dir;  // local batch 2 x 2 replicas x 2 micro-batches = 8
  expect_same_training(run(launch(4), tp_args(dir, 2, 2, {"--parallelism.data_parallel_replicate_degree", "2",
                                                           "--parallelism.data_parallel_shard_degree", "1"}),
                           dir));
}

TEST(LaunchTrain, TpThatDoesNotDivideTheSequenceIsAClearError) {
  test::TempDir dir;
  auto args = tp_args(dir, 2, 8, {"--training.seq_len", "31"});
  std::vector<std::string> argv = launch(2);
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = test::run_process(argv, {{"OMP_NUM_THREADS", "1"}}, std::chrono::seconds(120));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("training.seq_len 31 is not divisible by parallelism.tensor_parallel_degree 2"),
            std::string::npos)
      << r.output;
}

TEST(LaunchTrain, TorchrunNoPython) {
  const std::string torchrun = kSource + "/.venv/bin/torchrun";
  ASSERT_TRUE(std::filesystem::exists(torchrun)) << "run scripts/setup.sh";
  test::TempDir dir;
  expect_same_training(run({torchrun, "--standalone", "--nproc_per_node=2", "--no-python", kTitan},
                           train_args(dir.path(), 4), dir));
}

TEST(LaunchTrain, AWorkerKilledMidRunEndsTheJobNamingItsRank) {
  // Two FSDP workers train "forever"; once both log steps, one is killed with SIGKILL. The launcher
  // must exit non-zero, name the failed rank, and leave no worker behind.
  test::TempDir dir;
  const std::string marker = "kill-test-" + std::to_string(::getpid());
  auto args = train_args(dir.path(), 4);
  args.insert(args.end(), {"--training.steps", "1000000", "--metrics.log_freq", "1", "--job.description", marker});
  std::string cmd = kTitan + " launch --nproc-per-node 2 --master-port 0 --grace-seconds 2 --";
  for (const auto& a : args) cmd += " '" + a + "'";
  const std::string script =
      cmd + " > " + dir / "log" + " 2>&1 &\n"
      "launcher=$!\n"
      "for i in $(seq 600); do [ \"$(grep -c 'step:' " + dir / "log" + ")\" -ge 2 ] && break; sleep 0.1; done\n"
      "victim=$(pgrep -n -f 'titan train .*" + marker + "')\n"
      "kill -KILL \"$victim\"\n"
      "wait $launcher; code=$?\n"
      "cat " + dir / "log" + "\n"
      "sleep 1; echo left: $(pgrep -f 'titan .*" + marker + "' | wc -l)\n"
      "exit $code\n";
  // From a file, so that the marker is not on bash's own command line.
  std::ofstream(dir / "kill.sh") << script;
  auto r = test::run_process({"bash", dir / "kill.sh"}, {{"OMP_NUM_THREADS", "1"}}, std::chrono::seconds(180));
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("failed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("SIGKILL"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("left: 0"), std::string::npos) << r.output;
}

TEST(LaunchTrain, DegreesThatDoNotFitTheWorldAreAClearError) {
  test::TempDir dir;
  auto args = train_args(dir.path(), 4);
  args.insert(args.end(), {"--parallelism.data_parallel_shard_degree", "3"});
  std::vector<std::string> argv = launch(2);
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = test::run_process(argv, {}, std::chrono::seconds(120));
  EXPECT_NE(r.exit_code, 0);
  // Said once, by the launcher: for both ranks where each raised it before the launcher saw the other
  // fail, else for the first and the other named as stopped (on a loaded machine a rank may still be
  // starting when the other fails).
  const size_t first = r.output.find("there are 2 processes");
  EXPECT_NE(first, std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("there are 2 processes", first + 1), std::string::npos) << r.output;
  EXPECT_TRUE(r.output.find("titan launch: ranks 0, 1 (pid ") != std::string::npos ||
              r.output.find(", with the same error as rank ") != std::string::npos ||
              r.output.find("titan launch: stopping the other 1 worker(s)") != std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("stopping the other 0 worker(s)"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace titan
