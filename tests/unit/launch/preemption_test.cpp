// Preemption (job.preemption_signals): on SIGTERM every rank finishes its step, the ranks stop after the
// same step, its checkpoint is saved and titan exits 75; a rerun of the same command continues exactly
// as the uninterrupted run (same final weights, bitwise). A second signal exits at once with the
// previous checkpoint intact; a signal during a save never leaves half a checkpoint visible.
// The signal arrives either from outside (kill, as a scheduler sends it) or by fault injection
// (TITAN_FAULT_INJECT action=term: raised at an exact point of an exact step, on a chosen rank).
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>

namespace titan {
namespace {

namespace fs = std::filesystem;
const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";

std::vector<std::string> train(const std::string& dump, int steps, int local_batch = 4) {
  return {"train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder", dump,
          "--training.seq_len", "32", "--training.local_batch_size", std::to_string(local_batch),
          "--training.global_batch_size", "4", "--training.steps", std::to_string(steps),
          "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--checkpoint.enable",
          "--checkpoint.interval", "50"};
}

std::vector<std::string> with(std::vector<std::string> argv, const std::vector<std::string>& more) {
  argv.insert(argv.end(), more.begin(), more.end());
  return argv;
}

std::vector<std::string> titan(const std::vector<std::string>& args) { return with({kTitan}, args); }
std::vector<std::string> launch2(const std::vector<std::string>& args) {
  return with({kTitan, "launch", "--nproc-per-node", "2", "--master-port", "0", "--"}, args);
}

// The logged loss text of each step ("step: N  loss: X"), by step.
std::map<int, std::string> losses(const std::string& output) {
  static const std::regex line(R"(step:\s+(\d+)\s+loss:\s+(\S+))");
  std::map<int, std::string> out;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), line); it != std::sregex_iterator(); ++it)
    out[std::stoi((*it)[1])] = (*it)[2];
  return out;
}

// The step the run stopped at, from its log line "Preemption: ...: saved step N in DIR".
int saved_step(const std::string& output, const std::string& dump) {
  std::smatch m;
  const std::regex re("Preemption: SIGTERM received: saved step (\\d+) in (\\S+); exiting with code 75");
  if (!std::regex_search(output, m, re)) return -1;
  EXPECT_EQ(m[2].str(), dump + "/checkpoint/step-" + m[1].str()) << output;
  return std::stoi(m[1]);
}

bool complete_checkpoint(const std::string& dump, int step) {
  return fs::exists(dump + "/checkpoint/step-" + std::to_string(step) + "/index.json");
}

// Resumes the run in `dump` up to `steps` and checks that it ends bitwise where the uninterrupted run
// `reference` ended, logging the same losses after `from`.
void expect_resumes_like(const std::vector<std::string>& argv, const std::string& dump, int from,
                         const test::ProcessResult& reference, const std::string& reference_weights) {
  const std::string weights = dump + "/weights.safetensors";
  auto r = test::run_process(argv, {{"TITAN_DEBUG_DUMP_WEIGHTS", weights}, {"OMP_NUM_THREADS", "1"}},
                             std::chrono::seconds(300));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto got = losses(r.output), want = losses(reference.output);
  ASSERT_FALSE(got.empty()) << r.output;
  EXPECT_EQ(got.begin()->first, from + 1) << r.output;
  for (const auto& [step, loss] : got) EXPECT_EQ(loss, want.at(step)) << "step " << step;
  const auto a = safetensors::load(weights).tensors, b = safetensors::load(reference_weights).tensors;
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : b)
    if (name != "__losses__") EXPECT_TRUE(at::equal(a.at(name), t)) << name;
}

test::ProcessResult reference_run(const std::vector<std::string>& argv, const std::string& weights) {
  auto r = test::run_process(argv, {{"TITAN_DEBUG_DUMP_WEIGHTS", weights}, {"OMP_NUM_THREADS", "1"}},
                             std::chrono::seconds(300));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r;
}

TEST(Preemption, OneProcessSavesTheStepItStopsAtAndResumesLikeTheUninterruptedRun) {
  test::TempDir dir;
  const std::string ref = dir / "ref", run = dir / "run";
  const auto reference = reference_run(titan(train(ref, 12)), dir / "ref.safetensors");
  // SIGTERM during step 5: the ranks' vote at the end of step 5 carries it, read at the end of step 6.
  // One thread, as the reference: a CPU kernel's sums may depend on the thread count, and the weights
  // are compared bit for bit.
  auto r = test::run_process(titan(train(run, 12)),
                             {{"TITAN_FAULT_INJECT", "action=term,point=optimizer,step=5"}, {"OMP_NUM_THREADS", "1"}});
  EXPECT_EQ(r.exit_code, kExitPreempted) << r.output;
  EXPECT_EQ(saved_step(r.output, run), 6) << r.output;
  EXPECT_TRUE(complete_checkpoint(run, 6));
  EXPECT_EQ(losses(r.output).rbegin()->first, 6) << r.output;
  expect_resumes_like(titan(train(run, 12)), run, 6, reference, dir / "ref.safetensors");
}

TEST(Preemption, TwoRanksStopAfterTheSameStepWhenOneIsSignalled) {
  test::TempDir dir;
  const std::string ref = dir / "ref", run = dir / "run";
  const auto reference = reference_run(launch2(train(ref, 9, 2)), dir / "ref.safetensors");
  // Only rank 1 receives the signal (during step 4); both stop after step 5 and save it together.
  auto r = test::run_process(launch2(train(run, 9, 2)),
                             {{"TITAN_FAULT_INJECT", "action=term,point=optimizer,step=4,rank=1"}, {"OMP_NUM_THREADS", "1"}});
  EXPECT_EQ(r.exit_code, kExitPreempted) << r.output;
  EXPECT_EQ(saved_step(r.output, run), 5) << r.output;
  EXPECT_TRUE(complete_checkpoint(run, 5));
  EXPECT_NE(r.output.find("stopped for preemption (exit code 75); waiting for the other workers, restarting nothing"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("failed"), std::string::npos) << r.output;
  expect_resumes_like(launch2(train(run, 9, 2)), run, 5, reference, dir / "ref.safetensors");
}

// Four ranks as two nodes of two (LOCAL_WORLD_SIZE 2): the vote and the checkpoint's coordination run in
// two levels (each node's ranks, then the nodes' first ranks). Rank 3 alone is signalled during step 4;
// every rank stops after the same step, the checkpoint of that step is complete, and the resumed run
// logs the uninterrupted run's losses.
TEST(Preemption, FourRanksOnTwoNodesStopAfterTheSameStepAndResume) {
  test::TempDir dir;
  auto run4 = [&](const std::string& dump, int steps, const std::string& fault) {
    const std::string port = std::to_string(test::free_loopback_port());
    std::vector<std::vector<std::string>> argvs;
    std::vector<std::map<std::string, std::string>> envs;
    for (int rank = 0; rank < 4; ++rank) {
      argvs.push_back(titan(train(dump, steps, 1)));
      std::map<std::string, std::string> env = {
          {"RANK", std::to_string(rank)}, {"WORLD_SIZE", "4"},    {"LOCAL_RANK", std::to_string(rank % 2)},
          {"LOCAL_WORLD_SIZE", "2"},      {"GROUP_RANK", std::to_string(rank / 2)}, {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", port},          {"OMP_NUM_THREADS", "1"}};
      if (!fault.empty()) env["TITAN_FAULT_INJECT"] = fault;
      envs.push_back(env);
    }
    return test::run_processes(argvs, envs, std::chrono::seconds(300));
  };
  const auto reference = run4(dir / "ref", 9, "");
  for (const auto& r : reference) ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto stopped = run4(dir / "run", 9, "action=term,point=optimizer,step=4,rank=3");
  for (const auto& r : stopped) EXPECT_EQ(r.exit_code, kExitPreempted) << r.output;  // every rank, after the save
  EXPECT_EQ(saved_step(stopped[0].output, dir / "run"), 5) << stopped[0].output;  // (rank 0 logs)
  EXPECT_TRUE(complete_checkpoint(dir / "run", 5));
  const auto resumed = run4(dir / "run", 9, "");
  for (const auto& r : resumed) ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto got = losses(resumed[0].output), want = losses(reference[0].output);
  ASSERT_FALSE(got.empty()) << resumed[0].output;
  EXPECT_EQ(got.begin()->first, 6) << resumed[0].output;
  for (const auto& [step, loss] : got) EXPECT_EQ(loss, want.at(step)) << "step " << step;
}

// Runs `command` in the background, waits until its log shows `lines` step lines, sends `signal` to it,
// and returns its exit code and output.
test::ProcessResult signal_after_steps(const std::vector<std::string>& argv, const std::string& log, int lines,
                                       const std::string& signal, const std::string& then = "") {
  std::string cmd;
  for (const auto& a : argv) cmd += "'" + a + "' ";
  const std::string script = cmd + "> " + log + " 2>&1 &\npid=$!\n"
                             "for i in $(seq 1200); do [ \"$(grep -c 'step:' " + log + ")\" -ge " + std::to_string(lines) +
                             " ] && break; sleep 0.05; done\n"
                             "kill -" + signal + " $pid\n" + then + "wait $pid; code=$?\ncat " + log + "\nexit $code\n";
  return test::run_process({"bash", "-c", script}, {{"OMP_NUM_THREADS", "1"}}, std::chrono::seconds(300));
}

TEST(Preemption, SigtermToTheLauncherIsForwardedAndTheJobSaves) {
  test::TempDir dir;
  const std::string run = dir / "run";
  auto r = signal_after_steps(launch2(train(run, 100000, 2)), dir / "log", 3, "TERM");
  EXPECT_EQ(r.exit_code, kExitPreempted) << r.output;
  EXPECT_NE(r.output.find("titan launch: received SIGTERM, forwarding it to the workers"), std::string::npos) << r.output;
  const int step = saved_step(r.output, run);
  EXPECT_GE(step, 3) << r.output;
  EXPECT_TRUE(complete_checkpoint(run, step)) << r.output;
  EXPECT_EQ(r.output.find("failed"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("restarting"), std::string::npos) << r.output;
}

TEST(Preemption, SigtermToOneProcessFromOutside) {
  test::TempDir dir;
  const std::string run = dir / "run";
  auto r = signal_after_steps(titan(train(run, 100000)), dir / "log", 3, "TERM");
  EXPECT_EQ(r.exit_code, kExitPreempted) << r.output;
  const int step = saved_step(r.output, run);
  EXPECT_GE(step, 3) << r.output;
  EXPECT_TRUE(complete_checkpoint(run, step)) << r.output;
  // SIGUSR1 (SLURM's --signal=USR1@...) is a preemption signal by default too.
  test::TempDir dir2;
  auto u = signal_after_steps(titan(train(dir2 / "run", 100000)), dir2 / "log", 2, "USR1");
  EXPECT_EQ(u.exit_code, kExitPreempted) << u.output;
  EXPECT_NE(u.output.find("Preemption: SIGUSR1 received"), std::string::npos) << u.output;
  // Without preemption signals SIGTERM ends the run at once, as before.
  test::TempDir dir3;
  auto off = signal_after_steps(with(titan(train(dir3 / "run", 100000)), {"--job.preemption_signals", ""}),
                                dir3 / "log", 2, "TERM");
  EXPECT_EQ(off.exit_code, 128 + SIGTERM) << off.output;
  EXPECT_EQ(off.output.find("Preemption"), std::string::npos) << off.output;
}

TEST(Preemption, ASecondSignalExitsAtOnceAndThePreviousCheckpointStaysIntact) {
  test::TempDir dir;
  const std::string run = dir / "run";
  // Checkpoints every 2 steps; the first SIGTERM comes during step 3, so the run stops after step 4,
  // whose save then stalls half-written. The second SIGTERM (3 s after the first) ends it there.
  auto args = with(titan(train(run, 100)), {"--checkpoint.interval", "2"});
  std::string cmd;
  for (const auto& a : args) cmd += "'" + a + "' ";
  const std::string log = dir / "log";
  const std::string script =
      "export TITAN_FAULT_INJECT='action=term,point=optimizer,step=3;action=sleep,seconds=120,point=checkpoint_data,step=4'\n" +
      cmd + "> " + log + " 2>&1 &\npid=$!\n"
      "for i in $(seq 1200); do grep -q 'sleeps 120 s' " + log + " && break; sleep 0.05; done\n"
      "sleep 2.5; kill -TERM $pid; wait $pid; code=$?\ncat " + log + "\nexit $code\n";
  auto r = test::run_process({"bash", "-c", script}, {{"OMP_NUM_THREADS", "1"}}, std::chrono::seconds(100));
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.output;
  EXPECT_NE(r.output.find("a second preemption signal: exiting now"), std::string::npos) << r.output;
  EXPECT_TRUE(complete_checkpoint(run, 2));
  EXPECT_FALSE(fs::exists(run + "/checkpoint/step-4")) << "half a checkpoint is visible";
  // The next run resumes from step 2 (the interrupted save's leftovers are cleaned up).
  auto next = test::run_process(with(titan(train(run, 3)), {"--checkpoint.interval", "2"}));
  EXPECT_EQ(next.exit_code, 0) << next.output;
  EXPECT_EQ(losses(next.output).begin()->first, 3) << next.output;
}

TEST(Preemption, ASignalDuringABackgroundSaveLetsItCompleteThenSavesTheStopStep) {
  test::TempDir dir;
  const std::string run = dir / "run";
  // The background save of step 2 takes 3 s; SIGTERM arrives during step 3, the run stops after step 4.
  auto r = test::run_process(
      with(titan(train(run, 100)), {"--checkpoint.interval", "2", "--checkpoint.async_mode", "async"}),
      {{"TITAN_FAULT_INJECT", "action=sleep,seconds=3,point=checkpoint_data,step=2;action=term,point=optimizer,step=3"}});
  EXPECT_EQ(r.exit_code, kExitPreempted) << r.output;
  EXPECT_EQ(saved_step(r.output, run), 4) << r.output;
  EXPECT_TRUE(complete_checkpoint(run, 2));
  EXPECT_TRUE(complete_checkpoint(run, 4));
}

TEST(Preemption, AGraceDeadlineExitsAtOnce) {
  test::TempDir dir;
  const std::string run = dir / "run";
  // The stop step's save stalls; job.preemption_grace_seconds = 2 ends the run with the previous checkpoint.
  auto r = test::run_process(
      with(titan(train(run, 100)), {"--checkpoint.interval", "2", "--job.preemption_grace_seconds", "2"}),
      {{"TITAN_FAULT_INJECT", "action=term,point=optimizer,step=3;action=sleep,seconds=60,point=checkpoint_data,step=4"}},
      std::chrono::seconds(50));
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.output;
  EXPECT_NE(r.output.find("job.preemption_grace_seconds = 2) ran out"), std::string::npos) << r.output;
  EXPECT_TRUE(complete_checkpoint(run, 2));
  EXPECT_FALSE(fs::exists(run + "/checkpoint/step-4"));
}

TEST(Preemption, BadSignalNamesAreRefused) {
  auto r = test::run_process({kTitan, "train", "--job.preemption_signals", "SIGKILL"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("SIGKILL cannot serve as a preemption notice"), std::string::npos) << r.output;
  r = test::run_process({kTitan, "train", "--job.preemption_signals", "SIGTERM,SIGINT"});
  EXPECT_NE(r.output.find("SIGINT cannot serve as a preemption notice"), std::string::npos) << r.output;
  r = test::run_process({kTitan, "train", "--job.preemption_signals", "SIGTERN"});
  EXPECT_NE(r.output.find("'SIGTERN' is not a signal"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace titan
