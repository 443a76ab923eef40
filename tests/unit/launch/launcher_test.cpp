// `titan launch` through the real binary, with the diagnostic `debug-worker` as the workers: the
// environment each worker sees, output prefixes and filters, failures, signals, timeouts, and that no
// worker (or child of one) outlives the launcher.
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/distributed/process_group.h"
#include "titan/launch/launcher.h"

#include <gtest/gtest.h>

#include <csignal>
#include <cstdlib>
#include <fcntl.h>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <sys/wait.h>
#include <filesystem>
#include <thread>
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace titan::dist {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";

// Node 0's launcher binds the rendezvous port: tests that give none take a free one, so that tests
// running at the same time do not compete for the default 29500.
test::ProcessResult launch(std::vector<std::string> args, const std::map<std::string, std::string>& env = {}) {
  const bool port_given = std::any_of(args.begin(), args.end(), [](const std::string& a) {
    return a.rfind("--master", 0) == 0 || a == "--standalone";
  });
  if (!port_given) args.insert(args.begin(), {"--master-port", "0"});
  args.insert(args.begin(), {kTitan, "launch"});
  return test::run_process(args, env, 60s);
}

// The values of "[rank R]: KEY=VALUE" lines, by rank.
std::map<int, std::string> values(const std::string& output, const std::string& key) {
  std::map<int, std::string> out;
  const std::regex line("^\\[rank (\\d+)\\]: " + key + "=(.*)$");
  std::istringstream in(output);
  std::string l;
  std::smatch m;
  while (std::getline(in, l))
    if (std::regex_match(l, m, line)) out[std::stoi(m[1])] = m[2];
  return out;
}

int count_lines_with(const std::string& output, const std::string& prefix) {
  std::istringstream in(output);
  std::string l;
  int n = 0;
  while (std::getline(in, l)) n += l.rfind(prefix, 0) == 0;
  return n;
}

// Alive and not a zombie (a reparented zombie may linger until init reaps it).
bool alive(int pid) {
  if (kill(pid, 0) != 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(stat)), {});
  const auto paren = s.rfind(')');
  return paren == std::string::npos || paren + 2 >= s.size() || s[paren + 2] != 'Z';
}

bool gone_soon(int pid) {  // allows a moment for processes that die asynchronously
  for (int i = 0; i < 100 && alive(pid); ++i) std::this_thread::sleep_for(20ms);
  return !alive(pid);
}

void expect_all_gone(const std::map<int, std::string>& pids) {
  ASSERT_FALSE(pids.empty());
  for (const auto& [rank, pid] : pids) EXPECT_TRUE(gone_soon(std::stoi(pid))) << "rank " << rank << " pid " << pid;
}

TEST(Launcher, WorkerEnvironment) {
  auto r = launch({"--nproc-per-node", "3", "--master-port", "0", "--", "debug-worker", "--print-env"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto rank = values(r.output, "env RANK"), local = values(r.output, "env LOCAL_RANK");
  const auto port = values(r.output, "env MASTER_PORT");
  ASSERT_EQ(rank.size(), 3u) << r.output;
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(rank.at(i), std::to_string(i));
    EXPECT_EQ(local.at(i), std::to_string(i));
    EXPECT_EQ(values(r.output, "env WORLD_SIZE").at(i), "3");
    EXPECT_EQ(values(r.output, "env LOCAL_WORLD_SIZE").at(i), "3");
    EXPECT_EQ(values(r.output, "env GROUP_RANK").at(i), "0");
    EXPECT_EQ(values(r.output, "env MASTER_ADDR").at(i), "127.0.0.1");
    const char* omp = std::getenv("OMP_NUM_THREADS");  // the launcher keeps a value it inherits
    EXPECT_EQ(values(r.output, "env OMP_NUM_THREADS").at(i), omp ? omp : "1");
    EXPECT_EQ(port.at(i), port.at(0));
  }
  const int p = std::stoi(port.at(0));
  EXPECT_GT(p, 0);
  EXPECT_LT(p, 65536);
  // What the trainer reads back through launch_env_from_environment():
  EXPECT_NE(r.output.find("[rank 2]: launch_env rank 2/3 (local 2/3, node 0) master 127.0.0.1:" + port.at(0) +
                          " [torchrun]"),
            std::string::npos)
      << r.output;
}

TEST(Launcher, SecondNodeOfTwoWithTorchrunSpellings) {
  auto r = launch({"--nnodes=2", "--node_rank", "1", "--nproc_per_node=2", "--master_addr", "10.1.2.3",
                   "--master_port=4321", "debug-worker", "--print-env"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 2]: launch_env rank 2/4 (local 0/2, node 1) master 10.1.2.3:4321 [torchrun]"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 3]: launch_env rank 3/4 (local 1/2, node 1) master 10.1.2.3:4321 [torchrun]"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(values(r.output, "env NODE_RANK").at(3), "1");
  EXPECT_EQ(r.output.find("[rank 0]"), std::string::npos);
}

// --log-dir: every line of every worker in torchrun's layout, shown on the console or not; --redirects
// keeps a stream off the console; --role and --rdzv-id reach the workers.
TEST(Launcher, LogDirHoldsEveryWorkersOutput) {
  namespace fs = std::filesystem;
  auto read = [](const std::string& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  // The launcher's own folder under `base`: <run id>_<unique>, the only entry.
  auto run_folder = [](const std::string& base, const std::string& run_id) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(base)) names.push_back(e.path().filename().string());
    EXPECT_EQ(names.size(), 1u) << ::testing::PrintToString(names);
    EXPECT_TRUE(!names.empty() && names[0].rfind(run_id + "_", 0) == 0) << ::testing::PrintToString(names);
    return names.empty() ? base : base + "/" + names[0];
  };
  test::TempDir dir;
  auto r = launch({"--nproc-per-node", "2", "--local-ranks-filter", "0", "--log-dir", dir.path(), "--role", "trainer",
                   "--rdzv-id", "job7", "--", "debug-worker", "--lines", "3", "--print-env"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(values(r.output, "env ROLE_NAME").at(0), "trainer");
  EXPECT_EQ(values(r.output, "env TORCHELASTIC_RUN_ID").at(0), "job7");
  EXPECT_EQ(count_lines_with(r.output, "[rank 1]: "), 0) << r.output;
  const std::string run = run_folder(dir.path(), "job7");
  EXPECT_NE(r.output.find("titan launch: the workers' output is also written under " + run), std::string::npos)
      << r.output;
  for (int lr = 0; lr < 2; ++lr) {
    const std::string out = read(run + "/attempt_0/" + std::to_string(lr) + "/stdout.log");
    const std::string err = read(run + "/attempt_0/" + std::to_string(lr) + "/stderr.log");
    for (int i = 0; i < 3; ++i) {
      const std::string suffix = " line " + std::to_string(i) + " of rank " + std::to_string(lr) + "\n";
      EXPECT_NE(out.find("stdout" + suffix), std::string::npos) << out;
      EXPECT_NE(err.find("stderr" + suffix), std::string::npos) << err;
      EXPECT_EQ(out.find("stderr" + suffix), std::string::npos) << out;
    }
    EXPECT_NE(out.find("env RANK=" + std::to_string(lr) + "\n"), std::string::npos) << out;
    EXPECT_EQ(out.find("[rank"), std::string::npos) << out;  // the worker's own lines, unprefixed
  }
  // --redirects 2: stderr only in the files; --tee 1 adds stdout's files; no --log-dir: under $TMPDIR.
  test::TempDir tmp;
  r = launch({"--nproc-per-node", "1", "--redirects", "2", "--tee", "1", "--", "debug-worker", "--lines", "2"},
             {{"TMPDIR", tmp.path()}});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_lines_with(r.output, "[rank 0]: stderr"), 0) << r.output;
  EXPECT_EQ(count_lines_with(r.output, "[rank 0]: stdout"), 2) << r.output;
  const std::string quiet = run_folder(tmp.path(), "none");
  EXPECT_NE(read(quiet + "/attempt_0/0/stderr.log").find("stderr line 1 of rank 0"), std::string::npos);
  EXPECT_NE(read(quiet + "/attempt_0/0/stdout.log").find("stdout line 1 of rank 0"), std::string::npos);
  // A stream both teed and redirected is shown too (tee wins, as in torchrun).
  test::TempDir both;
  r = launch({"--nproc-per-node", "1", "--log-dir", both.path(), "--redirects", "3", "--tee", "2", "--",
              "debug-worker", "--lines", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_lines_with(r.output, "[rank 0]: stderr"), 2) << r.output;
  EXPECT_EQ(count_lines_with(r.output, "[rank 0]: stdout"), 0) << r.output;
  // A second launcher with the same --log-dir writes a folder of its own (nodes sharing a file system).
  r = launch({"--nproc-per-node", "1", "--log-dir", dir.path(), "--rdzv-id", "job7", "--", "debug-worker"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  size_t folders = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) folders += e.is_directory();
  EXPECT_EQ(folders, 2u);
  // A folder that cannot be made is named before any worker starts.
  std::ofstream(dir / "a-file") << "x";
  r = launch({"--nproc-per-node", "2", "--log-dir", dir / "a-file/logs", "--", "debug-worker", "--print-pid"});
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("cannot create the folder " + (dir / "a-file/logs") + " for the workers' log files"),
            std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("pid="), std::string::npos) << r.output;
}

TEST(Launcher, StandalonePicksAFreePort) {
  auto r = launch({"--standalone", "--nproc-per-node", "1", "--", "debug-worker", "--print-env"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(values(r.output, "env MASTER_ADDR").at(0), "127.0.0.1");
  EXPECT_NE(values(r.output, "env MASTER_PORT").at(0), "0");
}

TEST(Launcher, PrefixesWholeLines) {
  auto r = launch({"--nproc-per-node", "2", "--", "debug-worker", "--lines", "200", "--partial", "no newline"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Every line of both workers and streams arrives whole, with its own rank's prefix.
  const std::regex good("^\\[rank (\\d)\\]: (stdout|stderr) line \\d+ of rank (\\d)$|^\\[rank \\d\\]: no newline$");
  std::istringstream in(r.output);
  std::string l;
  std::smatch m;
  int worker_lines = 0;
  while (std::getline(in, l)) {
    ASSERT_TRUE(std::regex_match(l, m, good)) << "mangled line: '" << l << "'";
    if (m[1].matched) {
      EXPECT_EQ(m[1], m[3]) << l;
    }
    ++worker_lines;
  }
  EXPECT_EQ(worker_lines, 2 * (200 * 2 + 1));
  EXPECT_EQ(count_lines_with(r.output, "[rank 1]: no newline"), 1);
}

TEST(Launcher, FiltersOutputByLocalRank) {
  auto r = launch({"--nproc-per-node", "3", "--local-ranks-filter", "0,2", "--", "debug-worker", "--lines", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(count_lines_with(r.output, "[rank 0]: "), 4);
  EXPECT_EQ(count_lines_with(r.output, "[rank 1]: "), 0);
  EXPECT_EQ(count_lines_with(r.output, "[rank 2]: "), 4);

  auto e = launch({"--nproc-per-node", "2", "--", "debug-worker", "--lines", "2"}, {{"LOG_RANK", "1"}});
  ASSERT_EQ(e.exit_code, 0) << e.output;
  EXPECT_EQ(count_lines_with(e.output, "[rank 0]: "), 0);
  EXPECT_EQ(count_lines_with(e.output, "[rank 1]: "), 4);

  // The option wins over LOG_RANK.
  auto both = launch({"--nproc-per-node", "2", "--local-ranks-filter", "0", "--", "debug-worker", "--lines", "1"},
                     {{"LOG_RANK", "1"}});
  EXPECT_EQ(count_lines_with(both.output, "[rank 0]: "), 2);
  EXPECT_EQ(count_lines_with(both.output, "[rank 1]: "), 0);
}

TEST(Launcher, FailingWorkerStopsTheOthers) {
  const auto start = Clock::now();
  auto r = launch({"--nproc-per-node", "3", "--local-ranks-filter", "0", "--", "debug-worker", "--print-pid",
                   "--lines", "3", "--sleep-ms", "30000", "--fail-rank", "1", "--fail-after-ms", "300",
                   "--exit-code", "3"});
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 3) << r.output;
  EXPECT_LT(secs, 10.0) << r.output;
  // Rank 1 is filtered out of the stream, but its pid and last lines are in the report.
  EXPECT_EQ(values(r.output, "pid").count(1), 0u);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex("titan launch: rank 1 \\(pid (\\d+)\\) failed with exit code 3")))
      << r.output;
  EXPECT_NE(r.output.find("titan launch: last lines of rank 1:\n  [rank 1]: pid=" + m[1].str()), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("  [rank 1]: stderr line 2 of rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("stopping the other 2 worker(s)"), std::string::npos) << r.output;
  auto pids = values(r.output, "pid");
  pids[1] = m[1];
  expect_all_gone(pids);
}

TEST(Launcher, KilledWorkerIsNamedWithItsSignal) {
  auto r = launch({"--nproc-per-node", "2", "--", "debug-worker", "--print-pid", "--sleep-ms", "30000", "--fail-rank",
                   "0", "--fail-after-ms", "200", "--raise", "KILL"});
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("titan launch: rank 0 \\(pid \\d+\\) failed: killed by SIGKILL")))
      << r.output;
  // A SIGKILL the launcher did not send is most often the kernel's out-of-memory killer: said so.
  EXPECT_NE(r.output.find("killed by SIGKILL (not sent by titan launch: most often the kernel's out-of-memory killer"),
            std::string::npos) << r.output;
  expect_all_gone(values(r.output, "pid"));
}

TEST(Launcher, ChildrenOfWorkersDoNotOutliveTheLauncher) {
  // Failure: the failing worker's child and the other worker with its child are stopped.
  auto r = launch({"--nproc-per-node", "2", "--", "debug-worker", "--print-pid", "--spawn-grandchild", "--sleep-ms",
                   "30000", "--fail-rank", "1", "--fail-after-ms", "200", "--exit-code", "1"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(values(r.output, "grandchild_pid").size(), 2u) << r.output;
  expect_all_gone(values(r.output, "grandchild_pid"));
  expect_all_gone(values(r.output, "pid"));
  // Success: what a worker leaves behind goes too.
  auto ok = launch({"--nproc-per-node", "1", "--", "debug-worker", "--spawn-grandchild"});
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  expect_all_gone(values(ok.output, "grandchild_pid"));
}

TEST(Launcher, SigkillAfterTheGracePeriod) {
  const auto start = Clock::now();
  auto r = launch({"--nproc-per-node", "2", "--grace-seconds", "1", "--", "debug-worker", "--print-pid",
                   "--ignore-stop-signals", "--sleep-ms", "30000", "--fail-rank", "0", "--fail-after-ms", "200",
                   "--exit-code", "2"});
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_GE(secs, 1.0);
  EXPECT_LT(secs, 10.0);
  EXPECT_NE(r.output.find("1 worker(s) still running after the grace period, sending SIGKILL"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("not sent by titan launch"), std::string::npos) << r.output;  // it was
  expect_all_gone(values(r.output, "pid"));
}

// --max-restarts: every attempt starts all workers again with the next TORCHELASTIC_RESTART_COUNT; a
// worker that keeps failing ends the job after the last restart with its exit code.
TEST(Launcher, MaxRestartsRestartsAllWorkersThenGivesUp) {
  auto r = launch({"--nproc-per-node", "2", "--max-restarts", "2", "--", "debug-worker", "--print-env", "--fail-rank",
                   "1", "--exit-code", "3", "--sleep-ms", "100"});
  EXPECT_EQ(r.exit_code, 3) << r.output;
  for (const std::string attempt : {"1", "2"})
    EXPECT_NE(r.output.find("titan launch: restarting all workers (restart " + attempt + " of 2) after rank 1 (node 0) "
                            "failed with exit code 3"),
              std::string::npos)
        << r.output;
  EXPECT_NE(r.output.find("no restarts left (--max-restarts 2); the job failed"), std::string::npos) << r.output;
  for (const std::string attempt : {"0", "1", "2"}) {
    EXPECT_NE(r.output.find("[rank 0]: env TORCHELASTIC_RESTART_COUNT=" + attempt), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("[rank 1]: env TORCHELASTIC_RESTART_COUNT=" + attempt), std::string::npos) << r.output;
  }
  EXPECT_EQ(r.output.find("TORCHELASTIC_RESTART_COUNT=3"), std::string::npos) << r.output;
  EXPECT_EQ(values(r.output, "env TORCHELASTIC_USE_AGENT_STORE").at(0), "True");
}

TEST(Launcher, NoRestartAfterTheTimeout) {
  auto r = launch({"--nproc-per-node", "1", "--max-restarts", "3", "--timeout-seconds", "1", "--", "debug-worker",
                   "--sleep-ms", "30000"});
  EXPECT_EQ(r.exit_code, 124) << r.output;
  EXPECT_EQ(r.output.find("restarting"), std::string::npos) << r.output;
}

TEST(Launcher, TimeoutStopsEveryone) {
  const auto start = Clock::now();
  auto r = launch({"--nproc-per-node", "2", "--timeout-seconds", "1.5", "--", "debug-worker", "--print-pid",
                   "--sleep-ms", "30000"});
  const double secs = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_EQ(r.exit_code, 124) << r.output;
  EXPECT_GE(secs, 1.5);
  EXPECT_LT(secs, 10.0);
  EXPECT_NE(r.output.find("timeout of 1.5 s (--timeout-seconds) reached"), std::string::npos) << r.output;
  expect_all_gone(values(r.output, "pid"));
}

// Starts the launcher in the background (output to `log`), waits until all `n` workers printed their pid.
pid_t start_launcher(const std::vector<std::string>& args, const std::string& log, int n) {
  std::vector<std::string> argv{kTitan, "launch", "--master-port", "0"};
  argv.insert(argv.end(), args.begin(), args.end());
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 1);
    dup2(fd, 2);
    std::vector<char*> cargv;
    for (auto& s : argv) cargv.push_back(s.data());
    cargv.push_back(nullptr);
    execv(kTitan.c_str(), cargv.data());
    _exit(127);
  }
  for (int i = 0; i < 1500; ++i) {
    std::ifstream in(log);
    const std::string out((std::istreambuf_iterator<char>(in)), {});
    if (static_cast<int>(values(out, "pid").size()) == n) break;
    std::this_thread::sleep_for(20ms);
  }
  return pid;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

TEST(Launcher, SigtermToTheLauncherStopsTheWorkers) {
  test::TempDir dir;
  const std::string log = dir / "log";
  const pid_t launcher =
      start_launcher({"--nproc-per-node", "2", "--max-restarts", "2", "--", "debug-worker", "--print-pid", "--sleep-ms",
                      "30000"}, log, 2);
  ASSERT_EQ(values(read_file(log), "pid").size(), 2u) << read_file(log);
  ASSERT_EQ(kill(launcher, SIGTERM), 0);
  int status = 0;
  ASSERT_EQ(waitpid(launcher, &status, 0), launcher);
  const std::string out = read_file(log);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << out;
  EXPECT_NE(out.find("titan launch: received SIGTERM, forwarding it to the workers"), std::string::npos) << out;
  EXPECT_EQ(out.find("restarting"), std::string::npos) << out;  // a signal is not a failure to restart from
  expect_all_gone(values(out, "pid"));
}

// A preemption signal to the launcher is forwarded (SIGUSR1 too); workers that save and exit 75 make
// the launcher exit 75, with no restart.
TEST(Launcher, PreemptionSignalsAreForwardedAndExit75IsNotAFailure) {
  test::TempDir dir;
  const std::string log = dir / "log";
  const pid_t launcher = start_launcher({"--nproc-per-node", "2", "--max-restarts", "2", "--", "debug-worker",
                                        "--print-pid", "--exit-on-signal", "75", "--sleep-ms", "30000"}, log, 2);
  ASSERT_EQ(values(read_file(log), "pid").size(), 2u) << read_file(log);
  ASSERT_EQ(kill(launcher, SIGUSR1), 0);
  int status = 0;
  ASSERT_EQ(waitpid(launcher, &status, 0), launcher);
  const std::string out = read_file(log);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), kExitPreempted) << out;
  EXPECT_NE(out.find("titan launch: received SIGUSR1, forwarding it to the workers"), std::string::npos) << out;
  EXPECT_EQ(count_lines_with(out, "[rank 0]: received SIGUSR1") + count_lines_with(out, "[rank 1]: received SIGUSR1"), 2)
      << out;
  EXPECT_EQ(out.find("restarting"), std::string::npos) << out;
  EXPECT_EQ(out.find("failed"), std::string::npos) << out;
  expect_all_gone(values(out, "pid"));
  // A worker that exits 75 by itself (signalled by the scheduler): the launcher waits for the others.
  auto r = launch({"--nproc-per-node", "2", "--max-restarts", "2", "--", "debug-worker", "--fail-rank", "1",
                   "--exit-code", "75", "--fail-after-ms", "100", "--sleep-ms", "1500"});
  EXPECT_EQ(r.exit_code, kExitPreempted) << r.output;
  EXPECT_NE(r.output.find("titan launch: rank 1 stopped for preemption (exit code 75); waiting for the other workers, "
                          "restarting nothing"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("restarting all"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("failed"), std::string::npos) << r.output;
}

TEST(Launcher, WorkersDieWithAKilledLauncher) {
  test::TempDir dir;
  const std::string log = dir / "log";
  const pid_t launcher =
      start_launcher({"--nproc-per-node", "2", "--", "debug-worker", "--print-pid", "--sleep-ms", "30000"}, log, 2);
  ASSERT_EQ(values(read_file(log), "pid").size(), 2u) << read_file(log);
  ASSERT_EQ(kill(launcher, SIGKILL), 0);
  int status = 0;
  waitpid(launcher, &status, 0);
  expect_all_gone(values(read_file(log), "pid"));  // PR_SET_PDEATHSIG
}

// The reference: torchrun itself starts titan (`--no-python`), and every rank reads the same
// environment that `titan launch` gives it.
TEST(Launcher, TorchrunEnvironmentIsReadTheSameWay) {
  const std::string py = test::python();
  const std::string torchrun = py.substr(0, py.rfind('/')) + "/torchrun";
  auto r = test::run_process({torchrun, "--standalone", "--nproc_per_node=2", "--no-python", kTitan, "launch",
                              "debug-worker", "--print-env"},
                             {}, 120s);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    std::smatch m;
    const std::regex line("launch_env rank " + std::to_string(rank) + "/2 \\(local " + std::to_string(rank) +
                          "/2, node 0\\) master (\\S+):(\\d+) \\[torchrun\\]");
    EXPECT_TRUE(std::regex_search(r.output, m, line)) << r.output;
  }
}

// A rank whose peers never start (launch variables left in a shell's environment, or a job whose other
// ranks failed to start) ends after comm.init_timeout_seconds with how many ranks came and what to
// check, not a backend's store key.
TEST(Launcher, ARankWhosePeersNeverStartSaysSo) {
  test::TempDir dir;
  const std::string port = std::to_string(test::free_loopback_port());  // for the store rank 0 hosts
  const auto start = Clock::now();
  auto r = test::run_process({kTitan, "train", "--job.config_file", std::string(TITAN_SOURCE_DIR) + "/configs/llama3_debugmodel.toml",
                              "--job.dump_folder", dir.path(), "--comm.init_timeout_seconds", "3"},
                             {{"RANK", "0"}, {"WORLD_SIZE", "3"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "3"},
                              {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}},
                             60s);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(Clock::now() - start, 30s);
  EXPECT_NE(r.output.find("titan train: error: only 1 of 3 ranks started within comm.init_timeout_seconds (3 s); "
                          "this is rank 0/3"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("must not inherit RANK, WORLD_SIZE"), std::string::npos) << r.output;
}

// The store's host ending while a rank waits for the others (rank 0 failed early) is named as such,
// at once, not as ranks that did not start when the timeout runs out.
TEST(Launcher, AStoreThatGoesAwayDuringStartUpIsNamed) {
  test::TempDir dir;
  auto store = dist::make_tcp_store("127.0.0.1", 0, /*is_server=*/true, std::chrono::seconds(30));
  const std::string port = std::to_string(dist::store_port(store));
  test::ProcessResult r;
  std::thread rank1([&] {
    r = test::run_process({kTitan, "train", "--job.config_file", std::string(TITAN_SOURCE_DIR) + "/configs/llama3_debugmodel.toml",
                           "--job.dump_folder", dir.path(), "--comm.init_timeout_seconds", "60"},
                          {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
                           {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}},
                          90s);
  });
  // Once rank 1 has counted itself in, the store's host goes away.
  const auto deadline = Clock::now() + 30s;
  while (Clock::now() < deadline && !(store->check({"titan/ranks_started"}))) std::this_thread::sleep_for(50ms);
  EXPECT_TRUE(store->check({"titan/ranks_started"}));
  store.reset();
  rank1.join();
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(r.seconds, 45.0) << r.output;
  EXPECT_NE(r.output.find("titan train: error: the rendezvous store at 127.0.0.1:" + port + " stopped answering after"),
            std::string::npos)
      << r.output;
}

TEST(Launcher, BadArgumentsThroughTheBinary) {
  auto r = launch({"--", "train"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("titan launch: error: titan launch needs --nproc-per-node N"), std::string::npos) << r.output;
  auto u = launch({"--nproc-per-node", "2", "--no-python", "train"});
  EXPECT_EQ(u.exit_code, 1);
  EXPECT_NE(u.output.find("unknown option '--no-python'. It is not needed"), std::string::npos) << u.output;
}

TEST(Launcher, HelpDoesNotListTheDiagnosticWorker) {
  auto h = launch({"--nproc-per-node", "2", "--help"});
  EXPECT_EQ(h.exit_code, 0);
  EXPECT_NE(h.output.find("--local-ranks-filter"), std::string::npos);
  EXPECT_EQ(h.output.find("debug-worker"), std::string::npos);
  auto top = test::run_process({kTitan, "--help"});
  EXPECT_EQ(top.output.find("debug-worker"), std::string::npos);
}

std::string parse_error(const std::vector<std::string>& args) {
  try {
    parse_launch_options(args);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TEST(LaunchOptions, Errors) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--nproc-per-node", "x", "--", "train"}, "--nproc-per-node takes a whole number, got 'x'"},
      {{"--nproc-per-node", "gpu", "--", "train"}, "'gpu' is not supported"},
      {{"--nproc-per-node", "0", "--", "train"}, "--nproc-per-node must be between 1"},
      {{"--nproc-per-node", "2", "--max-restarts", "-1", "--", "train"}, "--max-restarts must be between 0"},
      {{"--nproc-per-node", "2", "--max_restarts", "many", "--", "train"}, "--max-restarts takes a whole number"},
      {{"--nproc-per-node", "2", "--nnodes", "1:4", "--", "train"}, "elastic ranges like 1:4 are not supported"},
      {{"--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h0", "--", "train"},
       "--node-rank 2 is not below --nnodes 2"},
      {{"--nproc-per-node", "2", "--nnodes", "2", "--master-addr", "h0", "--master-port", "0", "--", "train"},
       "works on one node only"},
      {{"--nproc-per-node", "2", "--nnodes", "2", "--", "train"}, "--nnodes 2 needs --master-addr"},
      {{"--nproc-per-node", "2", "--local-ranks-filter", "0,5", "--", "train"}, "names local rank 5 but there are only 2"},
      {{"--nproc-per-node", "2", "--local-ranks-filter", "a", "--", "train"}, "'a' is not a rank"},
      {{"--nproc-per-node", "2"}, "nothing to launch"},
      {{"--nproc-per-node", "2", "--", "build/titan", "train"}, "not 'build/titan'"},
      {{"--nproc-per-node", "2", "--frobnicate", "--", "train"}, "unknown option '--frobnicate'"},
      {{"--nproc-per-node", "2", "--rdzv-backend", "etcd", "--", "train"}, "--rdzv-backend etcd is not supported"},
      {{"--nproc-per-node", "2", "--rdzv-conf", "x=1", "--", "train"}, "unknown option '--rdzv-conf'"},
      {{"--nproc-per-node", "2", "--nnodes", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "h0:29400", "--",
        "train"},
       "--rdzv-backend static with --nnodes 2 needs --node-rank K on each node"},
      {{"--nproc-per-node", "2", "--rdzv-endpoint", "h0:29400", "--master-addr", "h1", "--", "train"},
       "name different places to meet"},
      {{"--nproc-per-node", "2", "--rdzv-endpoint", "h0:0", "--", "train"}, "port 0 (any free port) works for one "
                                                                              "node on localhost only"},
      {{"--nproc-per-node", "2", "--rdzv-endpoint", ":29400", "--", "train"}, "names no host"},
      {{"--nproc-per-node", "2", "--rdzv-endpoint", "fe80::1", "--", "train"}, "write an IPv6 address in brackets"},
      {{"--nproc-per-node", "2", "--rdzv-id", "a/b", "--", "train"}, "must be a non-empty name without '/'"},
      {{"--nproc-per-node", "2", "--log-dir", "d", "--redirects", "0:3,1:0", "--", "train"},
       "a value per local rank is not supported"},
      {{"--nproc-per-node", "2", "--log-dir", "d", "--tee", "4", "--", "train"}, "--tee takes 0 (none)"},
      {{"--nproc-per-node"}, "--nproc-per-node needs a value"},
      {{"--standalone", "--master-port", "1234", "--nproc-per-node", "2", "--", "train"}, "drop --standalone"},
      {{"--nproc-per-node", "2", "--timeout-seconds", "-1", "--", "train"}, "positive number of seconds"},
  };
  for (const auto& [args, expected] : cases) {
    const std::string msg = parse_error(args);
    EXPECT_NE(msg.find(expected), std::string::npos) << "args: " << ::testing::PrintToString(args) << "\nmessage: " << msg;
  }
}

// Without --node-rank (torchrun's usual multi-node command: --nnodes, --rdzv-backend c10d,
// --rdzv-endpoint) the nodes are numbered at the rendezvous: the launcher on the endpoint's host
// hosts the store and is node 0, the others number themselves as they join. Two launchers on this
// machine (the first to bind the port hosts it) give ranks 0..3, each node its own two; a third
// launcher for a job of two nodes is refused with what to do, and the job of the first two runs.
TEST(Launcher, NodesWithoutNodeRankAreNumberedAtTheRendezvous) {
  const std::string endpoint = "127.0.0.1:" + std::to_string(test::free_loopback_port());
  for (const int launchers : {2, 3}) {
    SCOPED_TRACE(std::to_string(launchers) + " launchers");
    const std::vector<std::string> argv = {kTitan, "launch", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend",
                                           "c10d", "--rdzv-endpoint", endpoint, "--", "debug-worker", "--print-env",
                                           "--sleep-ms", "5000"};  // the host outlives every late joiner
    const auto results = test::run_processes(std::vector<std::vector<std::string>>(launchers, argv),
                                             std::vector<std::map<std::string, std::string>>(launchers), 60s);
    std::map<int, std::string> group;  // global rank -> its node, over every launcher's output
    int hosts = 0, refused = 0;
    for (const auto& r : results) {
      if (r.exit_code != 0) {
        ++refused;
        EXPECT_NE(r.output.find("more launchers than --nnodes 2 joined the rendezvous at " + endpoint), std::string::npos)
            << r.output;
        continue;
      }
      hosts += r.output.find("node 0 of 2 (numbered at the rendezvous at " + endpoint + ", which this launcher hosts)") !=
               std::string::npos;
      for (const auto& [rank, node] : values(r.output, "env GROUP_RANK")) {
        EXPECT_EQ(group.count(rank), 0u) << "rank " << rank << " twice";
        group[rank] = node;
        EXPECT_EQ(values(r.output, "env MASTER_ADDR").at(rank), "127.0.0.1");
      }
    }
    EXPECT_EQ(hosts, 1);
    EXPECT_EQ(refused, launchers - 2);
    const std::map<int, std::string> expected = {{0, "0"}, {1, "0"}, {2, "1"}, {3, "1"}};
    EXPECT_EQ(group, expected);
  }
}

// Launchers of one job that disagree (different --nproc-per-node, two given the same --node-rank)
// end within moments, each with why, rather than waiting for each other until comm.init_timeout_seconds
// or building a process group of the wrong ranks.
TEST(Launcher, LaunchersThatDisagreeEndAtOnceWithWhy) {
  test::TempDir dir;
  struct Case {
    std::string name;
    std::vector<std::vector<std::string>> launchers;  // each: its own arguments
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"another --nproc-per-node",
       {{"--node-rank", "0", "--nproc-per-node", "1"}, {"--node-rank", "1", "--nproc-per-node", "2"}},
       "was started with WORLD_SIZE "},
      // Restarts allowed: the same launch would be refused again, so nothing restarts.
      {"another --nproc-per-node, restarts allowed",
       {{"--node-rank", "0", "--nproc-per-node", "1", "--max-restarts", "2"},
        {"--node-rank", "1", "--nproc-per-node", "2", "--max-restarts", "2"}},
       "was started with WORLD_SIZE "},
      {"one --node-rank twice",
       {{"--node-rank", "0", "--nproc-per-node", "1"}, {"--node-rank", "1", "--nproc-per-node", "1"},
        {"--node-rank", "1", "--nproc-per-node", "1"}},
       "rank 1 of 2 was started twice: on "},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string port = std::to_string(test::free_loopback_port());
    std::vector<std::vector<std::string>> argvs;
    for (size_t i = 0; i < c.launchers.size(); ++i) {
      std::vector<std::string> argv = {kTitan, "launch", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
                                       port};
      argv.insert(argv.end(), c.launchers[i].begin(), c.launchers[i].end());
      argv.insert(argv.end(), {"--", "train", "--job.config_file",
                               std::string(TITAN_SOURCE_DIR) + "/configs/llama3_debugmodel.toml", "--job.dump_folder",
                               dir.path() + "/" + std::to_string(i), "--comm.init_timeout_seconds", "300",
                               "--training.steps", "1"});
      argvs.push_back(argv);
    }
    const auto start = Clock::now();
    const auto results =
        test::run_processes(argvs, std::vector<std::map<std::string, std::string>>(argvs.size()), 120s);
    int said = 0, failed = 0;
    for (const auto& r : results) {
      EXPECT_FALSE(r.timed_out) << r.output;
      said += r.output.find(c.expected) != std::string::npos;
      failed += r.exit_code != 0;
    }
    EXPECT_GE(said, 1);
    EXPECT_GE(failed, 1);
    EXPECT_LT(Clock::now() - start, 90s);  // not comm.init_timeout_seconds
    if (c.name.rfind("another --nproc-per-node", 0) == 0) {
      EXPECT_EQ(failed, 2);  // nobody trains: the job is not one world
      for (const auto& r : results) {
        EXPECT_NE(r.output.find("every launcher of a job must be given the same --nnodes and --nproc-per-node"),
                  std::string::npos)
            << r.output;
        EXPECT_EQ(r.output.find("restarting all workers"), std::string::npos) << r.output;
        if (c.name.find("restarts allowed") != std::string::npos)
          EXPECT_NE(r.output.find("not restarting: the ranks refused to start together (exit code 78"),
                    std::string::npos)
              << r.output;
      }
    }
    // A launcher whose own worker was refused exits with the worker's code (the duplicate --node-rank
    // case may come after the one-step job ended and its store went away: exit code 1 then).
    if (c.name.rfind("another --nproc-per-node", 0) == 0)
      for (const auto& r : results) EXPECT_EQ(r.exit_code, 78) << r.output;
  }
}

// The endpoint's port held on its host by a program that is not a store: the launcher there cannot
// host the rendezvous and says so within moments, rather than waiting on it as a client for the
// 15 minutes LibTorch's store client waits.
TEST(Launcher, AnEndpointPortHeldByAnotherProgramIsNamed) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(fd, 16), 0);  // accepts connections (the backlog) and never answers
  socklen_t len = sizeof addr;
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string endpoint = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  const auto r = test::run_process({kTitan, "launch", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                    "--rdzv-endpoint", endpoint, "--", "debug-worker"},
                                   {}, 90s);
  close(fd);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(r.seconds, 45.0) << r.output;
  EXPECT_NE(r.output.find("cannot join the rendezvous at " + endpoint + ": this machine is the endpoint's host but "
                          "could not host the store there ("),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("nothing answered as a rendezvous store within 15 s"), std::string::npos) << r.output;
}

// Which endpoint names this machine (the launcher there hosts the store): localhost, loopback, its
// host name, each address of its interfaces (IPv4 and IPv6); not a documentation-range address, a
// name that does not resolve, or 0.0.0.0 (no interface's address).
TEST(Launcher, NamesThisMachine) {
  EXPECT_TRUE(names_this_machine("localhost"));
  EXPECT_TRUE(names_this_machine("127.0.0.1"));
  EXPECT_TRUE(names_this_machine("127.0.1.1"));
  char name[256] = {};
  ASSERT_EQ(gethostname(name, sizeof name - 1), 0);
  EXPECT_TRUE(names_this_machine(name)) << name;
  EXPECT_FALSE(names_this_machine(std::string(name) + ".invalid"));
  EXPECT_FALSE(names_this_machine("0.0.0.0"));
  ifaddrs* interfaces = nullptr;
  ASSERT_EQ(getifaddrs(&interfaces), 0);
  std::set<std::string> addresses;
  for (ifaddrs* i = interfaces; i; i = i->ifa_next) {
    if (!i->ifa_addr || (i->ifa_addr->sa_family != AF_INET && i->ifa_addr->sa_family != AF_INET6)) continue;
    char text[INET6_ADDRSTRLEN] = {};
    const void* bytes = i->ifa_addr->sa_family == AF_INET
                            ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr)
                            : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr);
    ASSERT_NE(inet_ntop(i->ifa_addr->sa_family, bytes, text, sizeof text), nullptr);
    addresses.insert(text);
  }
  freeifaddrs(interfaces);
  EXPECT_FALSE(addresses.empty());
  for (const std::string& a : addresses) EXPECT_TRUE(names_this_machine(a)) << a;
  ASSERT_EQ(addresses.count("192.0.2.1"), 0u);
  EXPECT_FALSE(names_this_machine("192.0.2.1"));  // TEST-NET-1: no machine's
  EXPECT_FALSE(names_this_machine("2001:db8::1"));
}

// torchrun's rendezvous and logging options, as its multi-node commands spell them.
TEST(LaunchOptions, TorchrunRendezvousAndLogOptions) {
  auto o = parse_launch_options({"--nnodes=2", "--nproc_per_node=8", "--rdzv_id", "101", "--rdzv_backend", "c10d",
                                 "--rdzv_endpoint=h0:29401", "--node_rank", "1", "--role", "trainer", "train"});
  EXPECT_EQ(o.master_addr, "h0");
  EXPECT_EQ(o.master_port, 29401);
  EXPECT_EQ(o.node_rank, 1);
  EXPECT_EQ(o.run_id, "101");
  EXPECT_EQ(o.role, "trainer");
  EXPECT_TRUE(o.log_dir.empty());
  o = parse_launch_options({"--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2", "--rdzv-endpoint", "h0",
                            "--", "train"});
  EXPECT_EQ(o.master_port, 29400);  // torchrun's c10d default
  o = parse_launch_options({"--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "h0", "--", "train"});
  EXPECT_EQ(o.node_rank, -1);  // numbered at the rendezvous
  o = parse_launch_options({"--nproc-per-node", "2", "--rdzv-backend", "static", "--rdzv-endpoint", "[fe80::1]:1234",
                            "--master-port", "1234", "--", "train"});
  EXPECT_EQ(o.master_addr, "fe80::1");
  EXPECT_EQ(o.master_port, 1234);
  o = parse_launch_options({"--nproc-per-node", "2", "--rdzv-endpoint", "localhost:0", "--", "train"});
  EXPECT_EQ(o.master_port, 0);
  EXPECT_EQ(parse_launch_options({"--nproc-per-node", "2", "--", "train"}).log_streams, 0);  // no files
  o = parse_launch_options({"--nproc-per-node", "2", "--log-dir", "logs", "--", "train"});
  EXPECT_EQ(o.log_dir, "logs");
  EXPECT_EQ(o.log_streams, 3);
  EXPECT_EQ(o.redirect_streams, 0);
  o = parse_launch_options({"--nproc-per-node", "2", "--log-dir", "logs", "--tee", "1", "--", "train"});
  EXPECT_EQ(o.log_streams, 1);
  o = parse_launch_options({"--nproc-per-node", "2", "--log-dir", "logs", "--redirects", "2", "--", "train"});
  EXPECT_EQ(o.log_streams, 2);
  EXPECT_EQ(o.redirect_streams, 2);
  o = parse_launch_options({"--nproc-per-node", "2", "--log-dir", "logs", "--tee", "0", "--", "train"});
  EXPECT_EQ(o.log_streams, 0);
  // torchtitan's run_train.sh line: --tee without --log-dir (files under $TMPDIR, as torchrun's).
  o = parse_launch_options({"--nproc_per_node=2", "--rdzv_backend", "c10d", "--rdzv_endpoint=localhost:0",
                            "--local-ranks-filter", "0", "--role", "rank", "--tee", "3", "train"});
  EXPECT_TRUE(o.log_dir.empty());
  EXPECT_EQ(o.log_streams, 3);
  EXPECT_EQ(o.tee_streams, 3);
}

TEST(LaunchOptions, LogRankEnvironment) {
  setenv("LOG_RANK", "1,0", 1);
  const auto o = parse_launch_options({"--nproc-per-node", "2", "train", "--training.steps", "3"});
  unsetenv("LOG_RANK");
  EXPECT_EQ(o.local_ranks_filter, (std::vector<int>{1, 0}));
  EXPECT_EQ(o.command, (std::vector<std::string>{"train", "--training.steps", "3"}));
  setenv("LOG_RANK", "all", 1);
  EXPECT_TRUE(parse_launch_options({"--nproc-per-node", "2", "train"}).local_ranks_filter.empty());
  setenv("LOG_RANK", "4", 1);
  EXPECT_NE(parse_error({"--nproc-per-node", "2", "--", "train"}).find("LOG_RANK names local rank 4"), std::string::npos);
  unsetenv("LOG_RANK");
}

}  // namespace
}  // namespace titan::dist
