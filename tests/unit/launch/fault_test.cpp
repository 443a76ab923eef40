// The fault-injection suite (docs/reliability.md): a rank killed (SIGKILL, like kill -9) at a random
// step of each point of training (data loading, forward, backward, optimizer step, inside a
// checkpoint save, inside a background save); with restarts the job ends like the uninterrupted run
// (the same logged loss at every step, bitwise the same final weights); without, every process exits
// non-zero in bounded time with the failed rank named and nothing left running. A rank that stops
// answering (SIGSTOP) is detected by the collective timeout, and the error names the mesh dimension,
// the operation and the rank that did not arrive.
//
// Two processes train the debug model for 8 steps (seq_len 32), saving at steps 3 and 6.
// TITAN_TEST_FAULT_SEED=S replays the random choices of a failing run (the seed is in its output).
#include "test_util.h"

#include "titan/components/checkpoint/safetensors.h"

#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>

namespace titan {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";
constexpr int kSteps = 8;

std::vector<std::string> train_args(const std::string& dump, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {
      "train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder", dump,
      "--model.hf_assets_path", kSource + "/assets/tokenizer", "--training.seq_len", "32",
      "--training.local_batch_size", "4", "--training.steps", std::to_string(kSteps), "--lr_scheduler.warmup_steps",
      "2", "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "3",
      "--checkpoint.last_save_model_only", "false", "--comm.train_timeout_seconds", "10"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

struct JobRun {
  test::ProcessResult result;
  std::map<int, std::string> losses;  // step -> the last loss logged for it (as printed)
  std::map<std::string, at::Tensor> weights;
};

std::map<int, std::string> logged_losses(const std::string& output) {
  std::map<int, std::string> out;
  const std::regex line(R"(\[rank 0\]: .* - step:\s+(\d+)\s+loss:\s+([-0-9.naif]+))");
  std::istringstream in(output);
  std::smatch m;
  for (std::string l; std::getline(in, l);)
    if (std::regex_search(l, m, line)) out[std::stoi(m[1])] = m[2];
  return out;
}

// `titan launch` with 2 workers (FSDP 2) and `launch_args`; the final weights come from rank 0.
JobRun launch(const std::string& dump, std::vector<std::string> launch_args, const std::string& faults,
              std::vector<std::string> extra = {}, int nproc = 2) {
  std::vector<std::string> argv = {kTitan, "launch", "--nproc-per-node", std::to_string(nproc), "--master-port", "0"};
  argv.insert(argv.end(), launch_args.begin(), launch_args.end());
  argv.push_back("--");
  auto args = train_args(dump, std::move(extra));
  argv.insert(argv.end(), args.begin(), args.end());
  JobRun run;
  const std::string weights = dump + "/weights.safetensors";
  run.result = test::run_process(argv, {{"TITAN_FAULT_INJECT", faults}, {"TITAN_DEBUG_DUMP_WEIGHTS", weights}}, 240s);
  run.losses = logged_losses(run.result.output);
  if (fs::exists(weights)) run.weights = safetensors::load(weights).tensors;
  return run;
}

const JobRun& uninterrupted() {
  static JobRun run = [] {
    static test::TempDir dir;
    return launch(dir.path(), {}, "");
  }();
  return run;
}

uint64_t seed() {
  static const uint64_t s = [] {
    const char* env = std::getenv("TITAN_TEST_FAULT_SEED");
    return env ? std::stoull(env) : static_cast<uint64_t>(std::random_device{}());
  }();
  return s;
}

struct Scenario {
  std::string point;
  std::vector<int> steps;  // where it may strike
  bool async = false;      // checkpoint.async_mode async
};

const std::vector<Scenario>& scenarios() {
  static const std::vector<Scenario> all = {
      {"data", {2, 3, 4, 5, 6, 7, 8}},          {"forward", {2, 3, 4, 5, 6, 7, 8}},
      {"backward", {2, 3, 4, 5, 6, 7, 8}},      {"optimizer", {2, 3, 4, 5, 6, 7, 8}},
      {"checkpoint_data", {3, 6}},              {"checkpoint_index", {3, 6}, /*async=*/true},
  };
  return all;
}

// The latest checkpoint complete when the fault struck: saves at 3 and 6 happen after their step, so a
// fault during step s (or during its save) leaves the saves of earlier steps.
int resume_step(int step) {
  int latest = 0;
  for (int saved : {3, 6})
    if (saved < step) latest = saved;
  return latest;
}

bool anything_left_running(const std::string& marker) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos || name == std::to_string(getpid())) continue;
    std::ifstream f(e.path() / "cmdline");
    std::string cmdline((std::istreambuf_iterator<char>(f)), {});
    std::ifstream st(e.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(st)), {});
    const auto paren = stat.rfind(')');
    const bool zombie = paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'Z';
    if (!zombie && cmdline.find(marker) != std::string::npos) return true;
  }
  return false;
}

void expect_same_job(const JobRun& run, const std::string& what) {
  const JobRun& ref = uninterrupted();
  ASSERT_EQ(ref.result.exit_code, 0) << ref.result.output;
  ASSERT_EQ(ref.losses.size(), static_cast<size_t>(kSteps)) << ref.result.output;
  EXPECT_EQ(run.losses, ref.losses) << what << "\n" << run.result.output;
  ASSERT_EQ(run.weights.size(), ref.weights.size()) << what;
  for (const auto& [name, t] : ref.weights) {
    if (name == "__losses__") continue;
    EXPECT_TRUE(at::equal(run.weights.at(name), t)) << what << ": " << name;
  }
}

TEST(FaultInjection, KilledRankRestartsAndTheJobEqualsTheUninterruptedRun) {
  std::mt19937_64 rng(seed());
  for (const Scenario& s : scenarios()) {
    const int rank = static_cast<int>(rng() % 2);
    const int step = s.steps[rng() % s.steps.size()];
    const std::string what = "seed " + std::to_string(seed()) + ": kill rank " + std::to_string(rank) + " at " +
                             s.point + " of step " + std::to_string(step) + (s.async ? " (async save)" : "");
    SCOPED_TRACE(what);
    test::TempDir dir;
    const std::string fault = "action=kill,point=" + s.point + ",step=" + std::to_string(step) + ",rank=" + std::to_string(rank);
    std::vector<std::string> extra;
    if (s.async) extra = {"--checkpoint.async_mode", "async"};
    JobRun run = launch(dir.path(), {"--max-restarts", "1"}, fault, extra);
    ASSERT_EQ(run.result.exit_code, 0) << run.result.output;
    const std::string& out = run.result.output;
    EXPECT_NE(out.find("titan launch: restarting all workers (restart 1 of 1) after rank " + std::to_string(rank) +
                       " (node 0) failed: killed by SIGKILL"),
              std::string::npos)
        << out;
    const int from = resume_step(step);
    if (from > 0) {
      EXPECT_NE(out.find("Restart 1: Checkpoint: resumed from " + dir.path() + "/checkpoint/step-" + std::to_string(from) +
                         " "),
                std::string::npos)
          << out;
    } else {
      EXPECT_NE(out.find("Restart 1: no complete checkpoint in " + dir.path() + "/checkpoint"), std::string::npos) << out;
    }
    expect_same_job(run, what);
  }
}

TEST(FaultInjection, WithoutRestartsEveryProcessStopsAndNothingIsLeft) {
  std::mt19937_64 rng(seed() + 1);
  for (const Scenario& s : scenarios()) {
    const int rank = static_cast<int>(rng() % 2);
    const int step = s.steps[rng() % s.steps.size()];
    const std::string what = "seed " + std::to_string(seed()) + ": kill rank " + std::to_string(rank) + " at " +
                             s.point + " of step " + std::to_string(step);
    SCOPED_TRACE(what);
    test::TempDir dir;
    std::vector<std::string> extra;
    if (s.async) extra = {"--checkpoint.async_mode", "async"};
    JobRun run = launch(dir.path(), {}, "action=kill,point=" + s.point + ",step=" + std::to_string(step) + ",rank=" +
                                         std::to_string(rank), extra);
    EXPECT_NE(run.result.exit_code, 0) << run.result.output;
    EXPECT_FALSE(run.result.timed_out);
    EXPECT_NE(run.result.output.find("titan launch: rank " + std::to_string(rank) + " (pid "), std::string::npos)
        << run.result.output;
    EXPECT_NE(run.result.output.find("failed: killed by SIGKILL"), std::string::npos) << run.result.output;
    // The whole job, start-up and the steps before the fault included, within the timeout + 10 s.
    EXPECT_LT(run.result.seconds, uninterrupted().result.seconds + 10 + 10) << run.result.output;
    EXPECT_FALSE(anything_left_running(dir.path()));
    EXPECT_FALSE(fs::exists(dir / ("checkpoint/step-" + std::to_string(kSteps))));
  }
}

// Without a supervisor (two processes started by hand, as a scheduler would), the survivor notices the
// dead rank in its next collective and exits non-zero on its own, naming it; the store host (rank 0)
// may be the one that dies.
TEST(FaultInjection, WithoutALauncherTheSurvivorExitsOnItsOwn) {
  for (const auto& [victim, point, step] : std::vector<std::tuple<int, std::string, int>>{
           {1, "backward", 4}, {0, "checkpoint_data", 3}}) {
    SCOPED_TRACE("rank " + std::to_string(victim) + " killed at " + point);
    test::TempDir dir;
    const std::string port = std::to_string(test::free_loopback_port());
    std::vector<std::vector<std::string>> argvs;
    std::vector<std::map<std::string, std::string>> envs;
    for (int rank = 0; rank < 2; ++rank) {
      auto args = train_args(dir.path());
      args.insert(args.begin(), kTitan);
      argvs.push_back(args);
      envs.push_back({{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", std::to_string(rank)},
                      {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port},
                      {"OMP_NUM_THREADS", "1"},
                      {"TITAN_FAULT_INJECT", "action=kill,point=" + point + ",step=" + std::to_string(step) +
                                                 ",rank=" + std::to_string(victim)}});
    }
    auto results = test::run_processes(argvs, envs, 120s);
    const auto& dead = results[victim];
    const auto& survivor = results[1 - victim];
    EXPECT_EQ(dead.exit_code, -1) << dead.output;  // killed by the signal
    EXPECT_FALSE(survivor.timed_out) << survivor.output;
    EXPECT_NE(survivor.exit_code, 0) << survivor.output;
    EXPECT_LT(survivor.seconds, dead.seconds + 10 + 10) << survivor.output;
    EXPECT_NE(survivor.output.find("error: "), std::string::npos) << survivor.output;
  }
}

// A rank killed in the middle of writing its part of a save, without a supervisor: rank 0, waiting for
// the others' parts, notices at once (the checkpoint group's connection to it closes) and exits within
// checkpoint.save_timeout_seconds + 10 s, naming rank 1 and the save, in the foreground and in the
// background. (A wait on the rendezvous store would last 30 minutes.)
TEST(FaultInjection, ARankKilledDuringASaveEndsTheJobInBoundedTimeNamingItAndTheSave) {
  for (const std::string mode : {"disabled", "async"}) {
    SCOPED_TRACE(mode);
    test::TempDir dir;
    const std::string port = std::to_string(test::free_loopback_port());
    std::vector<std::vector<std::string>> argvs;
    std::vector<std::map<std::string, std::string>> envs;
    for (int rank = 0; rank < 2; ++rank) {
      auto args = train_args(dir.path(), {"--checkpoint.async_mode", mode, "--checkpoint.save_timeout_seconds", "30"});
      args.insert(args.begin(), kTitan);
      argvs.push_back(args);
      envs.push_back({{"RANK", std::to_string(rank)}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", std::to_string(rank)},
                      {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port},
                      {"OMP_NUM_THREADS", "1"}, {"TITAN_FAULT_INJECT", "action=kill,point=checkpoint_data,step=3,rank=1"}});
    }
    auto results = test::run_processes(argvs, envs, 120s);
    const auto& dead = results[1];
    const auto& survivor = results[0];
    EXPECT_EQ(dead.exit_code, -1) << dead.output;
    EXPECT_FALSE(survivor.timed_out) << survivor.output;
    EXPECT_NE(survivor.exit_code, 0) << survivor.output;
    EXPECT_LT(survivor.seconds, dead.seconds + 30 + 10) << survivor.output;
    EXPECT_NE(survivor.output.find("ranks that did not arrive: 1"), std::string::npos) << survivor.output;
    // In the background too, the save's failure is said at once, naming the save and the rank.
    const std::string failed = "the checkpoint save of step 3 to " + dir.path() + "/checkpoint/step-3 failed: collective "
                               "gather #";
    const auto at = survivor.output.find(failed);
    EXPECT_NE(at, std::string::npos) << survivor.output;
    if (at != std::string::npos)
      EXPECT_NE(survivor.output.find("ranks that did not arrive: 1", at), std::string::npos) << survivor.output;
    EXPECT_FALSE(fs::exists(dir / "checkpoint/step-3"));
  }
}

// A rank that stops answering: the others' collective times out after comm.train_timeout_seconds, and
// the error names the mesh dimension, the operation and the rank that did not arrive. With two
// dimensions (TP 2 x FSDP 2), ranks blocked behind a blocked peer say so, and name the stopped rank.
TEST(FaultInjection, AStoppedRankIsDetectedAndNamed) {
  struct Case {
    std::vector<std::string> layout;
    int nproc;
    std::string dim;
  };
  for (const Case& c : std::vector<Case>{{{}, 2, "dp_shard_cp"},
                                         {{"--parallelism.tensor_parallel_degree", "2"}, 2, "tp"},
                                         {{"--parallelism.tensor_parallel_degree", "2"}, 4, "tp"}}) {
    SCOPED_TRACE(c.dim + " " + std::to_string(c.nproc));
    test::TempDir dir;
    auto extra = c.layout;
    extra.insert(extra.end(), {"--comm.train_timeout_seconds", "5", "--checkpoint.enable", "false",
                               "--training.local_batch_size", std::to_string(8 / c.nproc)});
    const auto start = std::chrono::steady_clock::now();
    JobRun run = launch(dir.path(), {}, "action=stop,point=forward,step=3,rank=1", extra, c.nproc);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::string& out = run.result.output;
    EXPECT_NE(run.result.exit_code, 0) << out;
    EXPECT_NE(out.find("fault injection: rank 1 sends itself SIGSTOP at forward of step 3"), std::string::npos) << out;
    // Rank 0 shares a group of this dimension with rank 1 in every layout here. Gloo words its timeout
    // either "Timed out ..." or "Application timeout caused pair closure", depending on which side
    // notices first; the report's own suffix names the setting that expired.
    const std::regex error("\\[rank 0\\]: titan train: error: collective \\w+ #\\d+ on mesh dimension '" + c.dim +
                           "' \\(ranks 0, 1\\) failed on rank 0: .+ \\[collective timeout 5 s, "
                           "comm.train_timeout_seconds\\]");
    EXPECT_TRUE(std::regex_search(out, error)) << out;
    EXPECT_NE(out.find("[rank 0]:   ranks that did not arrive: 1 "), std::string::npos) << out;
    EXPECT_EQ(out.find("disagree"), std::string::npos) << out;
    // The timeout, the report's window and the stop, with room for a loaded machine: bounded, not forever.
    EXPECT_LT(seconds, uninterrupted().result.seconds + 5 + 20) << out;
    EXPECT_FALSE(anything_left_running(dir.path()));
  }
}

// torchrun's own restarts (--max-restarts) resume the same way: the workers read its agent store under
// the attempt's prefix and TORCHELASTIC_RESTART_COUNT.
TEST(FaultInjection, TorchrunMaxRestartsResumes) {
  const std::string py = test::python();
  const std::string torchrun = py.substr(0, py.rfind('/')) + "/torchrun";
  test::TempDir dir;
  std::vector<std::string> argv = {torchrun, "--standalone", "--nproc_per_node=2", "--max-restarts=1",
                                   "--no-python", kTitan};
  auto args = train_args(dir.path());
  argv.insert(argv.end(), args.begin(), args.end());
  const std::string weights = dir / "weights.safetensors";
  JobRun run;
  run.result = test::run_process(argv, {{"TITAN_FAULT_INJECT", "action=kill,point=backward,step=5,rank=1"},
                                        {"TITAN_DEBUG_DUMP_WEIGHTS", weights}, {"OMP_NUM_THREADS", "1"}},
                                 240s);
  ASSERT_EQ(run.result.exit_code, 0) << run.result.output;
  // torchrun prefixes nothing: rank 0's lines are the ones with the loss.
  const std::regex line(R"(- step:\s+(\d+)\s+loss:\s+([-0-9.naif]+))");
  std::istringstream in(run.result.output);
  std::smatch m;
  for (std::string l; std::getline(in, l);)
    if (std::regex_search(l, m, line)) run.losses[std::stoi(m[1])] = m[2];
  run.weights = safetensors::load(weights).tensors;
  EXPECT_NE(run.result.output.find("Restart 1: Checkpoint: resumed from " + dir.path() + "/checkpoint/step-3 "),
            std::string::npos)
      << run.result.output;
  expect_same_job(run, "torchrun");
}

// Two nodes (two launchers on this machine): a rank of node 1 dies; both launchers restart their
// workers through the store of node 0's launcher, and the job completes like the uninterrupted one.
TEST(FaultInjection, TwoNodesRestartTogether) {
  test::TempDir dir;
  const std::string port = std::to_string(test::free_loopback_port());
  std::vector<std::vector<std::string>> argvs;
  for (int node = 0; node < 2; ++node) {
    std::vector<std::string> argv = {kTitan, "launch", "--nnodes", "2", "--node-rank", std::to_string(node),
                                     "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
                                     "--max-restarts", "1", "--"};
    auto args = train_args(dir.path());
    argv.insert(argv.end(), args.begin(), args.end());
    argvs.push_back(argv);
  }
  const std::map<std::string, std::string> env = {{"TITAN_FAULT_INJECT", "action=kill,point=backward,step=5,rank=1"},
                                                  {"TITAN_DEBUG_DUMP_WEIGHTS", dir / "weights.safetensors"},
                                                  {"GLOO_SOCKET_IFNAME", "lo"}, {"OMP_NUM_THREADS", "1"}};
  auto results = test::run_processes(argvs, {env, env}, 240s);
  ASSERT_EQ(results[0].exit_code, 0) << results[0].output << results[1].output;
  ASSERT_EQ(results[1].exit_code, 0) << results[0].output << results[1].output;
  EXPECT_NE(results[1].output.find("restarting all workers (restart 1 of 1) after rank 1 (node 1) failed: killed by "
                                   "SIGKILL"),
            std::string::npos)
      << results[1].output;
  EXPECT_NE(results[0].output.find("restarting all workers (restart 1 of 1)"), std::string::npos) << results[0].output;
  for (const auto& r : results)  // each node learns at once that every node finished (the store's count)
    EXPECT_EQ(r.output.find("did not report finishing"), std::string::npos) << r.output;
  JobRun run;
  run.result = results[0];
  run.losses = logged_losses(results[0].output);
  run.weights = safetensors::load(dir / "weights.safetensors").tensors;
  expect_same_job(run, "two nodes");
}

TEST(FaultInjection, MalformedSpecificationIsAClearError) {
  test::TempDir dir;
  auto args = train_args(dir.path());
  args.insert(args.begin(), kTitan);
  for (const auto& [spec, message] : std::vector<std::pair<std::string, std::string>>{
           {"action=explode,point=data,step=1", "unknown action 'explode'"},
           {"action=kill,point=somewhere,step=1", "unknown point 'somewhere'"},
           {"action=kill,point=data", "needs action and step"},
           {"action=kill,point=data,step=x", "step=x is not a non-negative integer"},
           {"kill", "'kill' is not key=value"}}) {
    auto r = test::run_process(args, {{"TITAN_FAULT_INJECT", spec}}, 60s);
    EXPECT_EQ(r.exit_code, 1) << spec << r.output;
    EXPECT_NE(r.output.find("TITAN_FAULT_INJECT: "), std::string::npos) << spec << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << spec << r.output;
  }
}

}  // namespace
}  // namespace titan
