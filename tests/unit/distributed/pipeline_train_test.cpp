// Pipeline parallelism through the real launcher equals the single-process run.
//
// Each layout trains the debug model (6 blocks, dim 256) for 10 steps on the bundled corpus with the
// same global batch of 8 sequences of 32 tokens; its per-step losses and final weights (written by
// TITAN_DEBUG_DUMP_WEIGHTS, gathered from every stage) are compared with one process training
// alone. Tolerances as in launch_train_test.cpp: losses 1e-5 relative at every step; final weights
// within 1% of lr x steps. Gradient clipping is active (max_norm 1, gradient norms ~1.2-1.4), so
// the norm summed over stages is checked too. The point-to-point bytes of every rank are checked
// against the activations and gradients the schedule moves (TITAN_DEBUG_DUMP_COMM).
//
// Every run matches point-to-point messages by order, as NCCL does (TITAN_P2P_ORDER_MATCHED=1: one
// Gloo tag per pair of ranks), so a message posted out of order swaps microbatches or hangs here as
// it would on a cluster; RunsWithTagsToo repeats a schedule with Gloo's tags.
#include "launched_training.h"
#include "test_util.h"

#include "titan/components/checkpoint/safetensors.h"
#include "titan/distributed/pipeline_schedule.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";
constexpr int kSteps = 10, kSeq = 32, kDim = 256;
constexpr double kLr = 8e-4;

std::vector<std::string> train_args(const std::string& dump, int local_batch, int steps = kSteps) {
  return {"train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder", dump,
          "--training.seq_len", std::to_string(kSeq), "--training.local_batch_size", std::to_string(local_batch),
          "--training.global_batch_size", "8", "--training.steps", std::to_string(steps),
          "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "5"};
}

using Result = test::LaunchedRun;

Result run(int nproc, std::vector<std::string> args, const test::TempDir& dir, bool order_matched = true) {
  return test::run_titan(nproc, args, dir, {{"TITAN_P2P_ORDER_MATCHED", order_matched ? "1" : "0"}});
}

const safetensors::Tensors& single_process() {
  static test::TempDir dir;
  static safetensors::Tensors result = run(1, train_args(dir.path(), 8), dir).weights;
  return result;
}

// Losses of steps first_step .. first_step + steps - 1; the final weights when the run ended at kSteps.
void expect_same_training(const safetensors::Tensors& got, int steps = kSteps, int first_step = 1) {
  ASSERT_FALSE(got.empty());
  ASSERT_EQ(got.at("__losses__").numel(), steps);
  test::expect_same_training(single_process(), got, first_step + steps - 1 == kSteps ? 0.01 * kLr * kSteps : 0,
                             first_step);
}

int64_t comm_bytes(const nlohmann::json& j, const std::string& group, const std::string& op) {
  return test::comm_bytes_per_step(j, group, op);
}

// Per step, every rank sends one activation per stage boundary it feeds on another rank and one
// gradient per boundary it feeds back, for every microbatch, and receives the mirror image:
// microbatch x (seq / sp) x dim x 4 bytes each.
void expect_pipeline_bytes(const Result& r, const dist::PipelineOrder& order, int num_stages, int microbatches,
                           int64_t message_bytes, int pp, int ranks_per_stage) {
  const std::vector<int> ranks = dist::stage_ranks(order, num_stages);
  ASSERT_EQ(static_cast<int>(r.comm.size()), pp * ranks_per_stage);
  for (size_t g = 0; g < r.comm.size(); ++g) {
    const int pp_rank = static_cast<int>(g) / ranks_per_stage;  // pp is the outermost mesh dimension
    int64_t sends = 0, recvs = 0;
    for (int s = 0; s + 1 < num_stages; ++s) {
      if (ranks[s] == ranks[s + 1]) continue;  // a handoff on one rank moves nothing
      // stage s -> s+1: activation; s+1 -> s: gradient.
      if (ranks[s] == pp_rank) sends += microbatches, recvs += microbatches;
      if (ranks[s + 1] == pp_rank) sends += microbatches, recvs += microbatches;
    }
    // Split backwards computed each weight gradient once, from the gradients captured in I.
    EXPECT_EQ(r.comm[g].at("pipeline_weight_pass_fallbacks").get<int64_t>(), 0) << "rank " << g;
    EXPECT_EQ(comm_bytes(r.comm[g], "pp", "send"), sends * message_bytes) << "rank " << g;
    EXPECT_EQ(comm_bytes(r.comm[g], "pp", "recv"), recvs * message_bytes) << "rank " << g;
  }
}

std::vector<std::string> pp_args(const test::TempDir& dir, int pp, const std::string& schedule,
                                 std::vector<std::string> extra = {}, int local_batch = 8) {
  auto args = train_args(dir.path(), local_batch);
  args.insert(args.end(), {"--parallelism.pipeline_parallel_degree", std::to_string(pp),
                           "--parallelism.pipeline_parallel_schedule", schedule});
  bool shard_set = false;
  for (const auto& a : extra) shard_set = shard_set || a == "--parallelism.data_parallel_shard_degree";
  if (!shard_set) args.insert(args.end(), {"--parallelism.data_parallel_shard_degree", "1"});
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// One schedule at PP 2 and PP 4 (8 microbatches of 1 sequence): losses, weights and bytes.
void check_schedule_runs(const std::string& schedule) {
  for (int pp : {2, 4}) {
    SCOPED_TRACE(schedule + " pp " + std::to_string(pp));
    test::TempDir dir;
    Result r = run(pp, pp_args(dir, pp, schedule), dir);
    expect_same_training(r.weights);
    const bool multi = schedule.find("Interleaved") != std::string::npos || schedule == "ZBVZeroBubble" ||
                       schedule == "LoopedBFS" || schedule == "DualPipeV";
    const int stages = pp * (multi ? 2 : 1);
    expect_pipeline_bytes(r, dist::schedule_by_name(schedule, pp, stages / pp, 8), stages, 8,
                          int64_t{1} * kSeq * kDim * 4, pp, 1);
  }
}

TEST(PipelineTrain, GPipe) { check_schedule_runs("GPipe"); }
TEST(PipelineTrain, RunsWithTagsToo) {
  test::TempDir dir;
  expect_same_training(run(2, pp_args(dir, 2, "1F1B"), dir, /*order_matched=*/false).weights);
}
TEST(PipelineTrain, OneFOneB) { check_schedule_runs("1F1B"); }
TEST(PipelineTrain, Interleaved1F1B) { check_schedule_runs("Interleaved1F1B"); }
TEST(PipelineTrain, InterleavedZeroBubble) { check_schedule_runs("InterleavedZeroBubble"); }
TEST(PipelineTrain, ZBVZeroBubble) { check_schedule_runs("ZBVZeroBubble"); }
TEST(PipelineTrain, LoopedBFS) { check_schedule_runs("LoopedBFS"); }
TEST(PipelineTrain, DualPipeV) { check_schedule_runs("DualPipeV"); }

// A schedule read from a CSV file: two stages per rank (looped), backward split into I and W with
// the weight passes last, idle slots included; 2 microbatches of 4 sequences.
TEST(PipelineTrain, CsvSchedule) {
  test::TempDir dir;
  const std::string csv = "0F0,0F1,2F0,2F1,2I0,2I1,0B0,0B1,2W0,2W1\n"
                          "1F0,1F1,3F0,3B0,3F1,3B1,1I0,,1I1,1W0,1W1\n";
  std::ofstream(dir / "schedule.csv") << csv;
  Result r = run(2, pp_args(dir, 2, "1F1B",
                         {"--parallelism.pipeline_parallel_schedule_csv", dir / "schedule.csv",
                          "--parallelism.pipeline_parallel_microbatch_size", "4"}),
              dir);
  EXPECT_NE(r.output.find("4 stages over 2 ranks (2 per rank), schedule " + (dir / "schedule.csv")),
            std::string::npos) << r.output;
  expect_same_training(r.weights);
  expect_pipeline_bytes(r, dist::parse_schedule_csv(csv), 4, 2, int64_t{4} * kSeq * kDim * 4, 2, 1);
}

// Composition: FSDP inside each stage (gradients reduce-scattered once per step), TP inside stages
// (sequence parallel: a quarter... half of the sequence crosses per rank), both with 8 processes;
// gradient accumulation; activation checkpointing with a split backward.
TEST(PipelineTrain, Pp2xFsdp2) {
  test::TempDir dir;
  Result r = run(4, pp_args(dir, 2, "1F1B", {"--parallelism.data_parallel_shard_degree", "2"}, 4), dir);
  expect_same_training(r.weights);
  expect_pipeline_bytes(r, dist::schedule_by_name("1F1B", 2, 1, 4), 2, 4, int64_t{1} * kSeq * kDim * 4, 2, 2);
}

// FSDP under pipeline parallelism (docs/parallelism.md): each unit is all-gathered once per step,
// at its first forward, stays gathered through every microbatch, and its gradients are
// reduce-scattered once after the step's last backward. Per step, on every dp_shard rank of a stage:
// all-gather and reduce-scatter bytes = the stage's parameters, each padded to a multiple of the
// shard degree in rows, in fp32: the same figure at 4 and at 8 microbatches. With
// fsdp_reshard_after_forward = "always" the units are gathered again for every forward and backward
// action: 2 x microbatches all-gathers, still one reduce-scatter.
TEST(PipelineTrain, FsdpGathersOncePerStepUnderPipelineParallelism) {
  const auto& ref = single_process();
  auto padded_bytes_of_stage = [&](int stage) {  // 1F1B at pp 2: stage 0 = embedding + layers 0-2
    int64_t bytes = 0;
    for (const auto& [name, t] : ref) {
      if (name == "__losses__") continue;
      const bool first = name.rfind("tok_embeddings", 0) == 0 ||
                         (name.rfind("layers.", 0) == 0 && std::stoi(name.substr(7)) < 3);
      if (first != (stage == 0)) continue;
      const int64_t rows = t.size(0), row = t.numel() / rows;
      bytes += (rows + 1) / 2 * 2 * row * 4;
    }
    return bytes;
  };
  for (const std::string reshard : {"default", "always"})
    for (int microbatches : {4, 8}) {
      SCOPED_TRACE(reshard + ", " + std::to_string(microbatches) + " microbatches");
      test::TempDir dir;
      // Local batch 8 (FSDP 2 x 8 = 16 sequences per step) in microbatches of 8 / m.
      auto args = pp_args(dir, 2, "1F1B", {"--parallelism.data_parallel_shard_degree", "2",
                                           "--parallelism.pipeline_parallel_microbatch_size",
                                           std::to_string(8 / microbatches), "--training.global_batch_size", "16",
                                           "--parallelism.fsdp_reshard_after_forward", reshard, "--training.steps", "2"});
      Result r = run(4, args, dir);
      ASSERT_EQ(r.comm.size(), 4u);
      for (int g = 0; g < 4; ++g) {
        const int64_t stage_bytes = padded_bytes_of_stage(g / 2);
        const int64_t gathers = reshard == "default" ? 1 : 2 * microbatches;
        EXPECT_EQ(comm_bytes(r.comm[g], "dp_shard_cp", "all_gather"), gathers * stage_bytes) << "rank " << g;
        EXPECT_EQ(comm_bytes(r.comm[g], "dp_shard_cp", "reduce_scatter"), stage_bytes) << "rank " << g;
      }
    }
}

// DDP inside each stage: gradients all-reduced once after the schedule, here after two accumulation
// micro-batches of 2 sequences per replica.
TEST(PipelineTrain, Pp2xDdp2WithGradientAccumulation) {
  test::TempDir dir;
  Result r = run(4, pp_args(dir, 2, "ZBVZeroBubble", {"--parallelism.data_parallel_replicate_degree", "2"}, 2), dir);
  expect_same_training(r.weights);
}

TEST(PipelineTrain, Pp2xTp2) {
  test::TempDir dir;
  Result r = run(4, pp_args(dir, 2, "Interleaved1F1B", {"--parallelism.tensor_parallel_degree", "2"}), dir);
  expect_same_training(r.weights);
  // Sequence parallel: each TP rank sends its half of the sequence.
  expect_pipeline_bytes(r, dist::schedule_by_name("Interleaved1F1B", 2, 2, 8), 4, 8, int64_t{1} * kSeq / 2 * kDim * 4, 2, 2);
}

TEST(PipelineTrain, Pp2xTp2xFsdp2) {
  test::TempDir dir;
  Result r = run(8, pp_args(dir, 2, "ZBVZeroBubble",
                         {"--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"}, 4),
              dir);
  expect_same_training(r.weights);
}

TEST(PipelineTrain, GradientAccumulationAndActivationCheckpointing) {
  {
    test::TempDir dir;  // 2 micro-batches of 4 per step, each run through the pipeline
    expect_same_training(run(2, pp_args(dir, 2, "1F1B", {}, 4), dir).weights);
  }
  for (const std::string mode : {"full", "selective"}) {
    SCOPED_TRACE(mode);
    test::TempDir dir;
    expect_same_training(run(2, pp_args(dir, 2, "InterleavedZeroBubble", {"--activation_checkpoint.mode", mode}), dir).weights);
  }
}

// Checkpoints hold every stage's parameters by global name: saved under PP 2 x FSDP 2, resumed
// without pipeline parallelism (FSDP 2) and with PP 4; the resumed losses are the uninterrupted run's.
TEST(PipelineTrain, CheckpointsReshardAcrossPipelineDegrees) {
  test::TempDir save;
  auto first = pp_args(save, 2, "1F1B", {"--parallelism.data_parallel_shard_degree", "2"}, 4);
  // --training.steps given twice: the last one counts (5 steps, then a save at step 5); the learning
  // rate follows the 10-step schedule of the uninterrupted run.
  first.insert(first.end(), {"--checkpoint.enable", "--checkpoint.interval", "5", "--training.steps", "5",
                             "--lr_scheduler.total_steps", "10"});
  Result a = run(4, first, save);
  ASSERT_FALSE(a.weights.empty());
  expect_same_training(a.weights, 5);
  for (int pp : {1, 4}) {
    SCOPED_TRACE("resume with pp " + std::to_string(pp));
    test::TempDir resume;
    std::filesystem::copy(save / "checkpoint", resume / "checkpoint", std::filesystem::copy_options::recursive);
    std::vector<std::string> args = pp == 1 ? train_args(resume.path(), 4) : pp_args(resume, 4, "1F1B");
    if (pp == 1) args.insert(args.end(), {"--parallelism.data_parallel_shard_degree", "2"});
    args.insert(args.end(), {"--checkpoint.enable", "--checkpoint.interval", "100"});
    Result b = run(pp == 1 ? 2 : 4, args, resume);
    EXPECT_NE(b.output.find("Checkpoint: resumed from"), std::string::npos) << b.output;
    EXPECT_NE(b.output.find("continuing at step 6"), std::string::npos) << b.output;
    expect_same_training(b.weights, 5, 6);
  }
}

// Validation runs the forwards through the pipeline: the same loss as one process.
TEST(PipelineTrain, ValidationEqualsOneProcess) {
  test::TempDir one, piped;
  auto with_validation = [](std::vector<std::string> args) {
    args.insert(args.end(), {"--validation.enable", "--validation.dataset", "c4_test", "--validation.freq", "5", "--validation.steps", "2",
                             "--validation.local_batch_size", "4", "--validation.seq_len", "64", "--training.steps", "5"});
    return args;
  };
  Result a = run(1, with_validation(train_args(one.path(), 8)), one);
  Result b = run(2, with_validation(pp_args(piped, 2, "Interleaved1F1B", {"--parallelism.pipeline_parallel_microbatch_size", "2"})),
              piped);
  auto r = test::run_process({kTitan, "report", "--check", one.path(), piped.path(), "--metric", "validation_loss"}, {},
                             std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("agree at all 2 common steps"), std::string::npos) << r.output;
}

// Bad splits and schedules are clear errors at start-up.
TEST(PipelineTrain, BadSplitsAreClearErrors) {
  auto expect_error = [](std::vector<std::string> extra, const std::string& pp, const std::string& want) {
    test::TempDir dir;
    auto args = train_args(dir.path(), 8, 1);
    args.insert(args.end(), {"--parallelism.pipeline_parallel_degree", pp, "--parallelism.data_parallel_shard_degree", "1"});
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<std::string> argv = {kTitan, "launch", "--nproc-per-node", pp, "--master-port", "0", "--"};
    argv.insert(argv.end(), args.begin(), args.end());
    auto r = test::run_process(argv, {{"OMP_NUM_THREADS", "1"}}, std::chrono::seconds(120));
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find(want), std::string::npos) << "wanted: " << want << "\n" << r.output;
  };
  // One effective layer per stage cannot hold an embedding weighing 3 (PipelineSplit.* covers more
  // stages than layers).
  expect_error({"--parallelism.pipeline_parallel_layers_per_stage", "1", "--parallelism.pipeline_parallel_first_stage_less_layers",
                "3", "--parallelism.pipeline_parallel_last_stage_less_layers", "3"}, "2",
               "with 12 stages each holds 1 effective layers, fewer than the embedding weight 3");
  expect_error({"--parallelism.pipeline_parallel_split_points", "layers.9"}, "2", "'layers.9' is not a module of the model");
  expect_error({"--parallelism.pipeline_parallel_split_points", "layers.4,layers.2"}, "2", "'layers.2' is out of order");
  expect_error({"--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0,layers.1,layers.2;layers.4,layers.5,norm,output"},
               "2", "'layers.4' (stage 1) is not next in the model's order: 'layers.3' comes first");
  expect_error({"--parallelism.pipeline_parallel_split_points", "layers.2,layers.4"}, "2", "do not divide evenly");
  expect_error({"--parallelism.pipeline_parallel_microbatch_size", "3"}, "2", "not a multiple of parallelism.pipeline_parallel_microbatch_size");
  expect_error({"--parallelism.pipeline_parallel_schedule", "Zigzag"}, "2", "Zigzag");
  // A tied embedding table needs its two holders, the first and the last stage, on two ranks.
  expect_error({"--model.flavor", "1B", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"}, "2",
               "the first and the last pipeline stage are on the same pipeline rank (schedule ZBVZeroBubble)");
}

}  // namespace
}  // namespace titan

namespace titan {
namespace {

// Activation memory follows the schedule: with 8 microbatches over 2 ranks, GPipe holds all 8
// microbatches' activations at its peak, 1F1B at most 2 (rank 0) and 1 (rank 1). Measured: the bytes
// allocated in the forward phase and alive at the step's peak, from each rank's CPU memory
// breakdown (profiling.enable_memory_snapshot).
TEST(PipelineTrain, OneFOneBHoldsFewerActivationsThanGPipe) {
  auto forward_bytes = [](const std::string& schedule) {
    test::TempDir dir;
    auto args = pp_args(dir, 2, schedule);
    args.insert(args.end(), {"--training.steps", "2", "--metrics.log_freq", "1", "--profiling.enable_memory_snapshot",
                             "--profiling.profile_freq", "2"});
    Result r = run(2, args, dir);
    std::vector<int64_t> out;
    for (int rank = 0; rank < 2; ++rank) {
      std::ifstream f(dir / ("memory_snapshot/iteration_2/rank" + std::to_string(rank) + "_cpu_memory.json"));
      EXPECT_TRUE(f.good()) << r.output;
      if (!f.good()) return std::vector<int64_t>{0, 0};
      out.push_back(nlohmann::json::parse(f).at("alive_by_phase").at("forward").get<int64_t>());
    }
    return out;
  };
  const std::vector<int64_t> gpipe = forward_bytes("GPipe"), one_f_one_b = forward_bytes("1F1B");
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    EXPECT_GT(gpipe[rank], 0);
    // 2 (rank 0) or 1 (rank 1) of 8 microbatches, with room for what is not per microbatch.
    EXPECT_LT(one_f_one_b[rank], gpipe[rank] * (rank == 0 ? 0.3 : 0.2)) << one_f_one_b[rank] << " vs " << gpipe[rank];
  }
}

}  // namespace
}  // namespace titan

namespace titan {
namespace {

// A stuck pipeline neighbour (SIGSTOP in its backward, on rank 0 whose stage computes no loss) fails
// the job within the collective timeout, naming the neighbour; no rank hangs.
TEST(PipelineTrain, StuckNeighbourFailsWithinTheTimeout) {
  test::TempDir dir;
  auto args = pp_args(dir, 2, "1F1B", {"--comm.train_timeout_seconds", "5", "--training.steps", "4"});
  std::vector<std::string> argv = {kTitan, "launch", "--nproc-per-node", "2", "--master-port", "0", "--"};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto start = std::chrono::steady_clock::now();
  auto r = test::run_process(argv, {{"OMP_NUM_THREADS", "1"}, {"TITAN_FAULT_INJECT", "action=stop,point=backward,step=2,rank=0"}},
                             std::chrono::seconds(120));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(seconds, 60) << r.output;
  EXPECT_NE(r.output.find("from rank 0 on mesh dimension 'pp' failed on rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("comm.train_timeout_seconds"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace titan
