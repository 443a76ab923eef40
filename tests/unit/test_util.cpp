#include "test_util.h"

#include "titan/common/error.h"

#include <ATen/ATen.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace titan::test {

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "titan-test-XXXXXX").string();
  if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

namespace {

// The value with_visible_gpus puts in: spawn replaces it by this process's own setting (or its absence).
const char* const kInheritGpus = "\x01inherit";

struct Child {
  pid_t pid = -1;
  std::string log_path;
};

Child spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
            const std::string& log_path) {
  std::map<std::string, std::string> merged;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) merged[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  // Processes a test starts see no GPU unless it hands them one (with_visible_gpus): their results are
  // compared with CPU runs, and several ranks cannot share a machine's one GPU.
  const auto inherited = merged.find("CUDA_VISIBLE_DEVICES");
  const std::optional<std::string> parent_gpus =
      inherited == merged.end() ? std::nullopt : std::optional<std::string>(inherited->second);
  merged["CUDA_VISIBLE_DEVICES"] = "";
  for (const auto& [k, v] : env) merged[k] = v;
  if (merged["CUDA_VISIBLE_DEVICES"] == kInheritGpus) {  // with_visible_gpus: as this process has it
    if (parent_gpus) merged["CUDA_VISIBLE_DEVICES"] = *parent_gpus;
    else merged.erase("CUDA_VISIBLE_DEVICES");
  }
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : merged) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, args;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);

  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);  // own group: a timeout kills its children too
  posix_spawnattr_setpgroup(&attr, 0);
  Child c;
  c.log_path = log_path;
  int rc = posix_spawnp(&c.pid, args[0], &actions, &attr, args.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) throw std::runtime_error("cannot start " + argv[0] + ": " + std::strerror(rc));
  return c;
}

std::vector<ProcessResult> wait_all(std::vector<Child>& children, std::chrono::seconds timeout) {
  std::vector<ProcessResult> results(children.size());
  std::vector<bool> done(children.size(), false);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  size_t remaining = children.size();
  while (remaining > 0) {
    for (size_t i = 0; i < children.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      pid_t r = waitpid(children[i].pid, &status, WNOHANG);
      if (r == children[i].pid) {
        done[i] = true;
        --remaining;
        results[i].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        results[i].seconds = elapsed();
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (size_t i = 0; i < children.size(); ++i) {
        if (done[i]) continue;
        kill(-children[i].pid, SIGKILL);
        int status = 0;
        waitpid(children[i].pid, &status, 0);
        results[i].timed_out = true;
        results[i].exit_code = -1;
        results[i].seconds = elapsed();
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (size_t i = 0; i < children.size(); ++i) {
    std::ifstream in(children[i].log_path);
    std::stringstream ss;
    ss << in.rdbuf();
    results[i].output = ss.str();
  }
  return results;
}

}  // namespace

ProcessResult run_process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
                          std::chrono::seconds timeout) {
  TempDir logs;
  std::vector<Child> children{spawn(argv, env, logs / "out.log")};
  return wait_all(children, timeout)[0];
}

std::vector<ProcessResult> run_processes(const std::vector<std::vector<std::string>>& argvs,
                                         const std::vector<std::map<std::string, std::string>>& envs,
                                         std::chrono::seconds timeout) {
  TempDir logs;
  std::vector<Child> children;
  for (size_t i = 0; i < argvs.size(); ++i)
    children.push_back(spawn(argvs[i], i < envs.size() ? envs[i] : std::map<std::string, std::string>{},
                             logs / ("process" + std::to_string(i) + ".log")));
  return wait_all(children, timeout);
}

std::vector<ProcessResult> run_workers(const std::string& worker, int n, const std::map<std::string, std::string>& env,
                                       std::chrono::seconds timeout) {
  TempDir logs;
  std::vector<Child> children;
  for (int rank = 0; rank < n; ++rank) {
    auto e = env;
    e["TITAN_TEST_WORKER"] = worker;
    e["TITAN_TEST_RANK"] = std::to_string(rank);
    children.push_back(spawn({"/proc/self/exe"}, e, logs / ("rank" + std::to_string(rank) + ".log")));
  }
  return wait_all(children, timeout);
}

std::map<std::string, std::string> with_visible_gpus(std::map<std::string, std::string> env) {
  env["CUDA_VISIBLE_DEVICES"] = kInheritGpus;
  return env;
}

std::string python() {
  // TITAN_TEST_PYTHON: an interpreter that has torch already (a GPU machine's preinstalled CUDA torch).
  const char* chosen = std::getenv("TITAN_TEST_PYTHON");
  std::string py = chosen && *chosen ? chosen : std::string(TITAN_SOURCE_DIR) + "/.venv/bin/python";
  if (access(py.c_str(), X_OK) != 0)
    throw std::runtime_error(py + " not found: run scripts/setup.sh to create the Python environment (or set "
                             "TITAN_TEST_PYTHON to a Python that has torch)");
  return py;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

double relative_error(const at::Tensor& actual, const at::Tensor& expected) {
  at::Tensor a = actual.detach().to(at::kCPU, at::kDouble), e = expected.detach().to(at::kCPU, at::kDouble);
  if (a.sizes() != e.sizes()) return std::numeric_limits<double>::infinity();
  const double scale = std::max(e.abs().max().item<double>(), 1e-30);
  return (a - e).abs().max().item<double>() / scale;
}

std::map<std::string, WorkerFn>& workers() {
  static std::map<std::string, WorkerFn> table;
  return table;
}

int free_loopback_port() {
  const int sock = socket(AF_INET, SOCK_STREAM, 0);
  if (sock < 0) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  const bool ok = bind(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  getsockname(sock, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  close(sock);
  if (!ok) throw std::runtime_error(std::string("no free port on 127.0.0.1: ") + std::strerror(errno));
  return ntohs(addr.sin_port);
}

}  // namespace titan::test
