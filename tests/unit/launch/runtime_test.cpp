// launch_env_from_environment: torchrun's variables, SLURM's, the single-process default, and the
// errors of partial or inconsistent environments. The environment is set in-process and restored.
#include "titan/common/error.h"
#include "test_util.h"
#include "titan/distributed/runtime.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

namespace titan::dist {
namespace {

const char* kVars[] = {"RANK",          "WORLD_SIZE",        "LOCAL_RANK",         "LOCAL_WORLD_SIZE",
                       "GROUP_RANK",    "NODE_RANK",         "MASTER_ADDR",        "MASTER_PORT",
                       "SLURM_PROCID",  "SLURM_NTASKS",      "SLURM_NPROCS",       "SLURM_LOCALID",
                       "SLURM_NODEID",  "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE",
                       "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID"};

// Clears every launch variable for the test and restores the original values afterwards.
class LaunchEnvTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : kVars) {
      if (const char* old = std::getenv(v)) saved_[v] = old;
      unsetenv(v);
    }
  }
  void TearDown() override {
    for (const char* v : kVars) unsetenv(v);
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }
  void set(const std::map<std::string, std::string>& vars) {
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
  }
  // The UserError message of launch_env_from_environment(), or "" when it succeeds.
  std::string error() {
    try {
      launch_env_from_environment();
    } catch (const UserError& e) {
      return e.what();
    }
    return "";
  }

 private:
  std::map<std::string, std::string> saved_;
};

#define EXPECT_ERROR_HAS(text)                                       \
  do {                                                               \
    const std::string msg = error();                                 \
    EXPECT_NE(msg.find(text), std::string::npos) << "message: " << msg; \
  } while (0)

TEST_F(LaunchEnvTest, SingleProcessByDefault) {
  const LaunchEnv e = launch_env_from_environment();
  EXPECT_EQ(e.source, "single");
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
}

TEST_F(LaunchEnvTest, Torchrun) {
  set({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}, {"GROUP_RANK", "1"},
       {"MASTER_ADDR", "node01"}, {"MASTER_PORT", "1234"}});
  const LaunchEnv e = launch_env_from_environment();
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.master_addr, "node01");
  EXPECT_EQ(e.master_port, 1234);
  EXPECT_EQ(describe(e), "rank 5/8 (local 1/4, node 1) master node01:1234 [torchrun]");
}

TEST_F(LaunchEnvTest, TorchrunNodeRankFallbacks) {
  set({{"RANK", "6"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "h"},
       {"MASTER_PORT", "1"}});
  EXPECT_EQ(launch_env_from_environment().node_rank, 1);  // 6 / 4
  set({{"NODE_RANK", "3"}});
  EXPECT_EQ(launch_env_from_environment().node_rank, 3);
}

TEST_F(LaunchEnvTest, TorchrunOneProcessNeedsNoMaster) {
  set({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"}});
  const LaunchEnv e = launch_env_from_environment();
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_EQ(e.master_addr, "127.0.0.1");
}

TEST_F(LaunchEnvTest, TorchrunPartial) {
  set({{"RANK", "0"}});
  EXPECT_ERROR_HAS("found RANK but not WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE");
  EXPECT_ERROR_HAS("titan launch --nproc-per-node");
}

TEST_F(LaunchEnvTest, TorchrunMissingMaster) {
  set({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}});
  EXPECT_ERROR_HAS("MASTER_PORT not set");
}

TEST_F(LaunchEnvTest, TorchrunNotANumber) {
  set({{"RANK", "one"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
       {"MASTER_PORT", "29500"}});
  EXPECT_ERROR_HAS("RANK is 'one', which is not a whole number");
  set({{"RANK", "1"}, {"WORLD_SIZE", "2x"}});
  EXPECT_ERROR_HAS("WORLD_SIZE is '2x'");
  set({{"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}});
  EXPECT_ERROR_HAS("MASTER_PORT is 70000, out of range");
  set({{"MASTER_PORT", "29500"}, {"LOCAL_RANK", "-1"}});
  EXPECT_ERROR_HAS("LOCAL_RANK is -1, out of range");
}

TEST_F(LaunchEnvTest, TorchrunInconsistent) {
  set({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
       {"MASTER_PORT", "29500"}});
  EXPECT_ERROR_HAS("RANK=2 is not below WORLD_SIZE=2");
  set({{"RANK", "1"}, {"LOCAL_RANK", "2"}});
  EXPECT_ERROR_HAS("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2");
  set({{"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"}});
  EXPECT_ERROR_HAS("LOCAL_WORLD_SIZE=4 exceeds WORLD_SIZE=2");
  set({{"WORLD_SIZE", "0"}});
  EXPECT_ERROR_HAS("WORLD_SIZE is 0, out of range");
}

TEST_F(LaunchEnvTest, TorchrunWinsOverSlurm) {
  set({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
       {"MASTER_PORT", "29500"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(launch_env_from_environment().source, "torchrun");
}

TEST_F(LaunchEnvTest, Slurm) {
  set({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "1"},
       {"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_JOB_NODELIST", "gpu[07-08]"}, {"SLURM_JOB_ID", "123456"}});
  const LaunchEnv e = launch_env_from_environment();
  EXPECT_EQ(e.source, "slurm");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.master_addr, "gpu07");
  EXPECT_EQ(e.master_port, 20000 + 123456 % 10000);
  // Overrides of the master, as torchtitan's sbatch script exports them.
  set({{"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "29400"}});
  const LaunchEnv o = launch_env_from_environment();
  EXPECT_EQ(o.master_addr, "10.0.0.1");
  EXPECT_EQ(o.master_port, 29400);
}

TEST_F(LaunchEnvTest, SlurmTasksPerNodeList) {
  // 3 + 3 + 2 tasks: the third node's first task is rank 6.
  set({{"SLURM_PROCID", "7"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}, {"SLURM_NODEID", "2"},
       {"SLURM_TASKS_PER_NODE", "3(x2),2"}, {"SLURM_JOB_NODELIST", "a1,b[2-3]"}});
  const LaunchEnv e = launch_env_from_environment();
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "a1");
  EXPECT_EQ(e.master_port, 29500);  // no job id: the default
  // The step's values take precedence over the job's.
  set({{"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}, {"SLURM_STEP_NODELIST", "c[5-6]"}, {"SLURM_NODEID", "1"},
       {"SLURM_LOCALID", "3"}});
  const LaunchEnv s = launch_env_from_environment();
  EXPECT_EQ(s.local_world_size, 4);
  EXPECT_EQ(s.master_addr, "c5");
}

TEST_F(LaunchEnvTest, SlurmErrors) {
  set({{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}});
  EXPECT_ERROR_HAS("neither SLURM_NTASKS nor SLURM_NPROCS");
  set({{"SLURM_NTASKS", "4"}});
  EXPECT_ERROR_HAS("none of SLURM_NTASKS_PER_NODE");
  set({{"SLURM_TASKS_PER_NODE", "2(x2)"}, {"SLURM_NODEID", "2"}});
  EXPECT_ERROR_HAS("SLURM_NODEID=2 but SLURM_TASKS_PER_NODE='2(x2)' lists 2 node(s)");
  set({{"SLURM_NODEID", "0"}, {"SLURM_PROCID", "4"}});
  EXPECT_ERROR_HAS("SLURM_PROCID=4 is not below SLURM_NTASKS=4");
  set({{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "2"}});
  EXPECT_ERROR_HAS("SLURM_LOCALID=2 is not below SLURM_TASKS_PER_NODE=2");
  set({{"SLURM_LOCALID", "0"}});
  EXPECT_ERROR_HAS("SLURM_JOB_NODELIST is not");
  set({{"SLURM_JOB_NODELIST", "n[1-2"}});
  EXPECT_ERROR_HAS("is not closed");
}

TEST(LocalDevice, SharedOrBound) {
  LaunchEnv e;
  e.local_rank = 3;
  e.local_world_size = 8;
  e.world_size = 8;
  EXPECT_EQ(local_device_index(e, 8, false), 3);  // all GPUs visible to every process
  EXPECT_EQ(local_device_index(e, 1, true), 0);   // one GPU bound to this task (CUDA_VISIBLE_DEVICES)
  // 8 processes and the node's one GPU: NCCL would refuse the duplicate GPU at the first collective.
  const std::string shared = test::error_of([&] { local_device_index(e, 1, false); });
  EXPECT_NE(shared.find("8 processes run on this node"), std::string::npos) << shared;
  EXPECT_NE(shared.find("--nproc-per-node 1"), std::string::npos) << shared;
  e.local_rank = 0;
  e.local_world_size = 1;
  EXPECT_EQ(local_device_index(e, 1, false), 0);  // one process, one GPU
  e.local_rank = 3;
  e.local_world_size = 8;
  try {
    local_device_index(e, 2, false);
    ADD_FAILURE() << "no error";
  } catch (const UserError& err) {
    EXPECT_NE(std::string(err.what()).find("only 2 CUDA devices are visible"), std::string::npos) << err.what();
  }
}

TEST(SlurmHostlist, Expands) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_slurm_hostlist("node[01-04,07],gpu5"), (V{"node01", "node02", "node03", "node04", "node07", "gpu5"}));
  EXPECT_EQ(expand_slurm_hostlist("n[8-11]"), (V{"n8", "n9", "n10", "n11"}));
  EXPECT_EQ(expand_slurm_hostlist("n[098-101]"), (V{"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expand_slurm_hostlist("r[1-2]n[1-2]"), (V{"r1n1", "r1n2", "r2n1", "r2n2"}));
  EXPECT_EQ(expand_slurm_hostlist("a-1.cluster,b[3]-ib"), (V{"a-1.cluster", "b3-ib"}));
  EXPECT_EQ(expand_slurm_hostlist("single"), (V{"single"}));
  EXPECT_TRUE(expand_slurm_hostlist("").empty());
}

TEST(SlurmHostlist, RejectsMalformed) {
  for (const char* bad : {"n[1-2", "n1-2]", "n[2-1]", "n[a-b]", "n[[1]]", "a,,b", "n[1-]"})
    EXPECT_THROW(expand_slurm_hostlist(bad), UserError) << bad;
}

TEST(SlurmTasksPerNode, Expands) {
  using V = std::vector<int>;
  EXPECT_EQ(expand_slurm_tasks_per_node("4(x2),3"), (V{4, 4, 3}));
  EXPECT_EQ(expand_slurm_tasks_per_node("8"), (V{8}));
  EXPECT_EQ(expand_slurm_tasks_per_node("2,1(x3)"), (V{2, 1, 1, 1}));
  for (const char* bad : {"", "4(2)", "4(x)", "x", "4(x2", "4,,2"})
    EXPECT_THROW(expand_slurm_tasks_per_node(bad), UserError) << bad;
}

TEST(SlurmMasterPort, DeterministicAndInRange) {
  EXPECT_EQ(slurm_default_master_port("123456"), 23456);
  EXPECT_EQ(slurm_default_master_port("7"), 20007);
  EXPECT_NE(slurm_default_master_port("1000"), slurm_default_master_port("1001"));
}

// [comm] trace_buf_size and its folder: the environment LibTorch's flight recorder and NCCL's
// watchdog read, torchtitan's variables; a value already in the environment is reported when changed.
TEST(FlightRecorder, SetsLibTorchsEnvironment) {
  const char* names[] = {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE",
                         "TORCH_NCCL_ASYNC_ERROR_HANDLING"};
  std::map<std::string, std::optional<std::string>> saved;
  for (const char* n : names) {
    const char* v = std::getenv(n);
    saved[n] = v ? std::optional<std::string>(v) : std::nullopt;
    ::unsetenv(n);
  }
  auto env = [](const char* n) { const char* v = std::getenv(n); return v ? std::string(v) : std::string("<unset>"); };
  test::TempDir dir;
  const std::string folder = (std::filesystem::path(dir.path()) / "out" / "comm_traces").string();
  EXPECT_TRUE(configure_flight_recorder(20000, folder, "rank_", /*nccl=*/true).empty());
  EXPECT_EQ(env("TORCH_FR_BUFFER_SIZE"), "20000");
  EXPECT_EQ(env("TORCH_NCCL_DUMP_ON_TIMEOUT"), "1");
  EXPECT_EQ(env("TORCH_FR_DUMP_TEMP_FILE"), folder + "/rank_");
  EXPECT_EQ(env("TORCH_NCCL_ASYNC_ERROR_HANDLING"), "3");
  EXPECT_TRUE(std::filesystem::is_directory(folder));
  // Changed values are reported; the same value is not.
  const auto changed = configure_flight_recorder(500, folder, "rank_", true);
  ASSERT_EQ(changed.size(), 1u);
  EXPECT_EQ(changed[0], "TORCH_FR_BUFFER_SIZE=20000 (now 500)");
  // Off: the buffer is 0 and nothing else changes. Gloo: the buffer only (no dump, no folder).
  for (const char* n : names) ::unsetenv(n);
  const std::string other = (std::filesystem::path(dir.path()) / "gloo").string();
  EXPECT_TRUE(configure_flight_recorder(0, other, "rank_", true).empty());
  EXPECT_EQ(env("TORCH_FR_BUFFER_SIZE"), "0");
  EXPECT_EQ(configure_flight_recorder(100, other, "rank_", /*nccl=*/false),
            std::vector<std::string>{"TORCH_FR_BUFFER_SIZE=0 (now 100)"});
  EXPECT_EQ(env("TORCH_FR_BUFFER_SIZE"), "100");
  EXPECT_EQ(env("TORCH_NCCL_DUMP_ON_TIMEOUT"), "<unset>");
  EXPECT_FALSE(std::filesystem::exists(other));
  // A folder that cannot be made is a clear error.
  std::ofstream(std::filesystem::path(dir.path()) / "file") << "x";
  const std::string e = test::error_of([&] { configure_flight_recorder(10, (std::filesystem::path(dir.path()) / "file" / "t").string(), "r", true); });
  EXPECT_NE(e.find("cannot create the flight recorder's folder"), std::string::npos) << e;
  EXPECT_NE(test::error_of([] { configure_flight_recorder(-1, "x", "r", true); }).find("comm.trace_buf_size must be 0"),
            std::string::npos);
  for (const char* n : names) {
    if (saved[n]) ::setenv(n, saved[n]->c_str(), 1);
    else ::unsetenv(n);
  }
}


// wait_for_every_rank: the ranks of one world meet; a rank whose WORLD_SIZE differs from the job's, or
// whose rank another process holds, ends with why, and every rank waiting with it ends at once with
// that message instead of at the timeout.
LaunchEnv rank_env(int rank, int world_size) {
  LaunchEnv e;
  e.rank = rank;
  e.world_size = e.local_world_size = world_size;
  e.local_rank = rank;
  e.source = "torchrun";
  return e;
}

// The UserError message of one rank's wait ("" when it returns), and how long it took; `refused`
// says whether it was a LaunchRefused (exit code 78: not restarted).
std::pair<std::string, double> wait_as(const c10::intrusive_ptr<c10d::Store>& store, const LaunchEnv& env,
                                       std::chrono::milliseconds timeout, bool* refused = nullptr) {
  const auto start = std::chrono::steady_clock::now();
  std::string msg;
  try {
    wait_for_every_rank(store, env, timeout);
  } catch (const UserError& e) {
    msg = e.what();
    if (refused) *refused = dynamic_cast<const LaunchRefused*>(&e) != nullptr;
  }
  return {msg, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

TEST(EveryRankStarted, OneWorldMeets) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::pair<std::string, double>> results(3);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 3; ++r)
    ranks.emplace_back([&, r] { results[r] = wait_as(store, rank_env(r, 3), std::chrono::seconds(60)); });
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_EQ(results[r].first, "") << "rank " << r;
}

TEST(EveryRankStarted, AnotherWorldSizeEndsEveryRankAtOnce) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::pair<std::string, double> first;
  bool first_refused = false, refused = false, late_refused = false;
  std::thread rank0([&] { first = wait_as(store, rank_env(0, 4), std::chrono::seconds(120), &first_refused); });
  while (!store->check({"titan/ranks_started"})) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const auto [msg, seconds] = wait_as(store, rank_env(1, 2), std::chrono::seconds(120), &refused);
  rank0.join();
  EXPECT_TRUE(refused && first_refused);  // the same launch would be refused again: exit code 78
  EXPECT_NE(msg.find("this rank (rank 1/2 (local 1/2, node 0) master 127.0.0.1:29500 [torchrun]) was started with "
                     "WORLD_SIZE 2 but ranks of the same job with 4: every launcher of a job must be given the same "
                     "--nnodes and --nproc-per-node"),
            std::string::npos)
      << msg;
  EXPECT_NE(first.first.find("the job cannot start (this is rank 0/4 (local 0/4, node 0) master 127.0.0.1:29500 "
                             "[torchrun]): another rank found: " + msg),
            std::string::npos)
      << first.first;
  EXPECT_LT(first.second, 30.0);  // woken, not timed out
  // A rank that comes later still learns it.
  EXPECT_NE(wait_as(store, rank_env(2, 4), std::chrono::seconds(120), &late_refused).first.find("another rank found: " + msg),
            std::string::npos);
  EXPECT_TRUE(late_refused);
}

// The rank's earlier process on this host has ended (a restart that reuses the store's keys): said as such.
TEST(EveryRankStarted, ARankStartedAgainOnAnEarlierStartsStoreIsNamed) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);  // a pid that has ended
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof host - 1), 0);
  const std::string ns = std::filesystem::read_symlink("/proc/self/ns/pid").string();
  const std::string earlier = std::string(host) + " (pid " + std::to_string(child) + ")#12345@" + ns;
  store->set("titan/rank_0", std::vector<uint8_t>(earlier.begin(), earlier.end()));
  const auto [msg, seconds] = wait_as(store, rank_env(0, 2), std::chrono::seconds(120));
  EXPECT_NE(msg.find("rank 0 of 2 was started again on the store of a start that already ran (its earlier process, " +
                     std::string(host) + " (pid " + std::to_string(child) + "), has ended)"),
            std::string::npos) << msg;
  EXPECT_EQ(msg.find("#12345"), std::string::npos) << msg;
  // The same pid in another pid namespace (a container of the same host name) is another process.
  auto store2 = c10::make_intrusive<c10d::HashStore>();
  const std::string other = std::string(host) + " (pid " + std::to_string(child) + ")#12345@pid:[1]";
  store2->set("titan/rank_0", std::vector<uint8_t>(other.begin(), other.end()));
  EXPECT_NE(wait_as(store2, rank_env(0, 2), std::chrono::seconds(120)).first.find("rank 0 of 2 was started twice"),
            std::string::npos);
}

// A rank that waited out the timeout records the outcome: a rank coming after it does not go on alone.
TEST(EveryRankStarted, ATimedOutStartStopsLateRanksToo) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  const auto [msg, seconds] = wait_as(store, rank_env(0, 2), std::chrono::milliseconds(500));
  EXPECT_NE(msg.find("only 1 of 2 ranks started within comm.init_timeout_seconds"), std::string::npos) << msg;
  bool refused = true;
  const auto late = wait_as(store, rank_env(1, 2), std::chrono::seconds(60), &refused).first;
  EXPECT_NE(late.find("another rank found: not every rank started within comm.init_timeout_seconds"),
            std::string::npos) << late;
  EXPECT_FALSE(refused);  // a late node: a restart may meet every rank, so not exit code 78
}

// A rank refused after the job started (the count was complete) does not stop the ranks that went on:
// the start's outcome is the one value written first.
TEST(EveryRankStarted, ARefusalAfterTheStartLeavesTheJobRunning) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::pair<std::string, double>> results(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] { results[r] = wait_as(store, rank_env(r, 2), std::chrono::seconds(60)); });
  for (auto& t : ranks) t.join();
  EXPECT_EQ(results[0].first, "");
  EXPECT_EQ(results[1].first, "");
  // Rank 1 once more (another claim of it): refused, and the outcome stays "ok".
  EXPECT_NE(wait_as(store, rank_env(1, 2), std::chrono::seconds(60)).first.find("rank 1 of 2 was started twice"),
            std::string::npos);
  const auto outcome = store->get("titan/every_rank_started");
  EXPECT_EQ(std::string(outcome.begin(), outcome.end()), "ok");
}

TEST(EveryRankStarted, ARankStartedTwiceEndsEveryRankAtOnce) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  // Rank 1 already held by another process (another launcher given the same --node-rank).
  const std::string other = "node7 (pid 4242)";
  store->set("titan/rank_1", std::vector<uint8_t>(other.begin(), other.end()));
  std::pair<std::string, double> first;
  std::thread rank0([&] { first = wait_as(store, rank_env(0, 3), std::chrono::seconds(120)); });
  while (!store->check({"titan/ranks_started"})) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const auto [msg, seconds] = wait_as(store, rank_env(1, 3), std::chrono::seconds(120));
  rank0.join();
  EXPECT_NE(msg.find("rank 1 of 3 was started twice: on node7 (pid 4242) and on "), std::string::npos) << msg;
  EXPECT_NE(msg.find("Two launchers were given the same --node-rank"), std::string::npos) << msg;
  EXPECT_NE(first.first.find("another rank found: " + msg), std::string::npos) << first.first;
  EXPECT_LT(first.second, 30.0);
}

}  // namespace
}  // namespace titan::dist
