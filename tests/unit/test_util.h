// Helpers shared by the unit tests: temporary folders, subprocesses, and worker processes.
//
// Multi-process tests re-run this test binary as workers: TITAN_TEST_WORKER=<name> selects a
// function registered with TITAN_TEST_WORKER_FN(name) instead of the tests (see main.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace titan::test {

// A fresh folder under the system temp dir, removed when the object goes out of scope.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

struct ProcessResult {
  int exit_code = -1;    // -1 when killed by a signal or timed out
  bool timed_out = false;
  std::string output;    // stdout and stderr together
  double seconds = 0;    // from the start until it ended (or was killed at the timeout)
};

// Runs argv[0] with arguments argv (no shell), extra environment `env` added, killing it after `timeout`.
// Processes started by these helpers see no GPU (CUDA_VISIBLE_DEVICES empty) unless `env` names
// CUDA_VISIBLE_DEVICES itself, as with_visible_gpus does: they train on the CPU, as the runs they are
// compared with do, even on a GPU machine.
ProcessResult run_process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {},
                          std::chrono::seconds timeout = std::chrono::seconds(300));

// A TCP port of 127.0.0.1 that was free a moment ago (for a store a test's processes meet at).
int free_loopback_port();

// Runs several processes at once (argvs[i] with envs[i] added) and waits for all of them.
std::vector<ProcessResult> run_processes(const std::vector<std::vector<std::string>>& argvs,
                                         const std::vector<std::map<std::string, std::string>>& envs,
                                         std::chrono::seconds timeout = std::chrono::seconds(300));

// Starts `n` copies of this test binary as workers of `worker` with TITAN_TEST_RANK=0..n-1 plus `env`,
// and waits for all of them. Results are in rank order.
std::vector<ProcessResult> run_workers(const std::string& worker, int n, const std::map<std::string, std::string>& env,
                                       std::chrono::seconds timeout = std::chrono::seconds(120));

// `env` for a process meant to run on the GPUs this test process sees: it gets this process's
// CUDA_VISIBLE_DEVICES as it is (unset stays unset). For one process: several would share the GPUs.
std::map<std::string, std::string> with_visible_gpus(std::map<std::string, std::string> env = {});

// The Python interpreter of the reference computations: TITAN_TEST_PYTHON (an absolute path, e.g. a
// GPU machine's python3 with its CUDA torch) when set, else the project's .venv.
std::string python();

// Largest absolute difference relative to the largest magnitude of `expected`.
double relative_error(const at::Tensor& actual, const at::Tensor& expected);

// The message of the titan::UserError that `f` throws, "" when it throws none.
std::string error_of(const std::function<void()>& f);

using WorkerFn = std::function<int()>;
std::map<std::string, WorkerFn>& workers();
struct RegisterWorker {
  RegisterWorker(const std::string& name, WorkerFn fn) { workers()[name] = std::move(fn); }
};

}  // namespace titan::test

#define TITAN_TEST_WORKER_FN(name)                                                     \
  static int titan_worker_##name();                                                    \
  static ::titan::test::RegisterWorker titan_register_worker_##name(#name, titan_worker_##name); \
  static int titan_worker_##name()

// In a worker function: when `cond` fails, print it (with file:line and an optional printf-style
// message) to stderr and return 1 from the worker.
#define TITAN_WORKER_CHECK(cond, ...)                                                  \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "%s:%d: check failed: %s", __FILE__, __LINE__, #cond);     \
      __VA_OPT__(std::fprintf(stderr, ": "); std::fprintf(stderr, __VA_ARGS__);)       \
      std::fprintf(stderr, "\n");                                                      \
      return 1;                                                                        \
    }                                                                                  \
  } while (0)
