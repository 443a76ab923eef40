// `titan launch debug-worker`: a diagnostic stand-in for a training worker, so the launcher's
// behaviour (environment, output relay, failure handling, signals) can be checked without a model.
// Not listed in the help. Options (all optional):
//   --print-env           print the launch variables and the parsed LaunchEnv, one "env NAME=VALUE" per line
//   --print-pid           print "pid=P"
//   --lines N             print N numbered lines to stdout and N to stderr
//   --partial TEXT        print TEXT without a trailing newline, just before ending
//   --spawn-grandchild    fork a child (same process group) that sleeps 60 s; print "grandchild_pid=P"
//   --ignore-stop-signals ignore SIGTERM and SIGINT (only SIGKILL stops it)
//   --exit-on-signal C    on SIGTERM, SIGUSR1 or SIGUSR2: print "received SIG..." and exit with code C
//   --sleep-ms MS         sleep before ending (default 0)
//   --fail-rank R         only global rank R ends with --exit-code / --raise; the others exit 0
//   --fail-after-ms MS    the failing rank's own delay instead of --sleep-ms
//   --exit-code C         exit code (default 0)
//   --raise SIG           end by raising a signal instead: KILL, TERM, SEGV, ABRT or INT
#include "titan/launch/launcher.h"
#include "titan/distributed/runtime.h"

#include "titan/common/error.h"

#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>

namespace titan::dist {

namespace {

long number_arg(const std::vector<std::string>& args, size_t& i) {
  TITAN_USER_CHECK(i + 1 < args.size(), "debug-worker: ", args[i], " needs a value");
  const std::string& v = args[++i];
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  TITAN_USER_CHECK(!v.empty() && *end == '\0', "debug-worker: ", args[i - 1], " takes a number, got '", v, "'");
  return n;
}

int signal_by_name(const std::string& name) {
  if (name == "KILL") return SIGKILL;
  if (name == "TERM") return SIGTERM;
  if (name == "SEGV") return SIGSEGV;
  if (name == "ABRT") return SIGABRT;
  if (name == "INT") return SIGINT;
  throw UserError("debug-worker: --raise takes KILL, TERM, SEGV, ABRT or INT, got '" + name + "'");
}

int g_exit_code_on_signal = -1;

void on_signal_exit(int sig) {
  char msg[64];
  const int n = std::snprintf(msg, sizeof msg, "received SIG%s\n", sigabbrev_np(sig));
  [[maybe_unused]] auto w = write(1, msg, static_cast<size_t>(n));
  _exit(g_exit_code_on_signal);
}

void sleep_ms(long ms) {
  if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

}  // namespace

int run_debug_worker(const std::vector<std::string>& args) {
  bool print_env = false, print_pid = false, grandchild = false, ignore_term = false;
  long lines = 0, sleep = 0, fail_rank = -1, fail_after = -1, exit_code = 0;
  int raise_sig = 0;
  std::string partial;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--print-env") print_env = true;
    else if (a == "--print-pid") print_pid = true;
    else if (a == "--spawn-grandchild") grandchild = true;
    else if (a == "--ignore-stop-signals") ignore_term = true;
    else if (a == "--exit-on-signal") g_exit_code_on_signal = static_cast<int>(number_arg(args, i));
    else if (a == "--lines") lines = number_arg(args, i);
    else if (a == "--sleep-ms") sleep = number_arg(args, i);
    else if (a == "--fail-rank") fail_rank = number_arg(args, i);
    else if (a == "--fail-after-ms") fail_after = number_arg(args, i);
    else if (a == "--exit-code") exit_code = number_arg(args, i);
    else if (a == "--raise" && i + 1 < args.size()) raise_sig = signal_by_name(args[++i]);
    else if (a == "--partial" && i + 1 < args.size()) partial = args[++i];
    else throw UserError("debug-worker: unknown option '" + a + "'");
  }
  if (ignore_term) {
    std::signal(SIGTERM, SIG_IGN);
    std::signal(SIGINT, SIG_IGN);
  }
  if (g_exit_code_on_signal >= 0)
    for (int sig : {SIGTERM, SIGUSR1, SIGUSR2}) std::signal(sig, on_signal_exit);

  const LaunchEnv env = launch_env_from_environment();
  if (print_pid) std::printf("pid=%d\n", static_cast<int>(getpid()));
  if (print_env) {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                             "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
                             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE", "ROLE_NAME",
                             "TORCHELASTIC_RUN_ID"}) {
      const char* v = std::getenv(name);
      std::printf("env %s=%s\n", name, v ? v : "<unset>");
    }
    std::printf("launch_env %s\n", describe(env).c_str());
  }
  std::fflush(stdout);
  if (grandchild) {
    const pid_t pid = fork();
    if (pid == 0) {
      sleep_ms(60000);  // bounded, in case the launcher under test fails to stop it
      _exit(0);
    }
    std::printf("grandchild_pid=%d\n", static_cast<int>(pid));
  }
  for (long i = 0; i < lines; ++i) {
    std::printf("stdout line %ld of rank %d\n", i, env.rank);
    std::fprintf(stderr, "stderr line %ld of rank %d\n", i, env.rank);
  }
  std::fflush(stdout);

  const bool fails = fail_rank < 0 || fail_rank == env.rank;
  sleep_ms(fails && fail_after >= 0 ? fail_after : sleep);
  if (!partial.empty()) std::fputs(partial.c_str(), stdout);
  std::fflush(stdout);
  if (!fails) return 0;
  if (raise_sig) {
    std::signal(raise_sig, SIG_DFL);
    std::raise(raise_sig);
  }
  return static_cast<int>(exit_code);
}

}  // namespace titan::dist
