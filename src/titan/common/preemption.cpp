#include "titan/common/preemption.h"

#include "titan/common/error.h"

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <mutex>

#include <unistd.h>

namespace titan {
namespace {

// Written by the signal handlers, read by the training loop.
volatile sig_atomic_t g_requested = 0;
volatile sig_atomic_t g_first_seconds = 0;  // CLOCK_MONOTONIC seconds of the first signal
volatile sig_atomic_t g_first_millis = 0;
// Prepared at installation: a handler may only make async-signal-safe calls.
unsigned g_grace_seconds = 0;
// Started by a launcher (titan launch, torchrun) that forwards the signals it receives: a repeat sent
// by the parent is that forwarded copy, never a second signal (the launcher kills on a second one).
bool g_parent_forwards = false;
char g_again_message[256];
char g_deadline_message[256];

std::mutex g_mutex;  // the installation (not the handlers)
int g_installed = 0;
std::vector<int> g_signals;
std::vector<struct sigaction> g_previous;
struct sigaction g_previous_alarm {};

void write_stderr(const char* s) {
  size_t n = std::strlen(s), off = 0;
  while (off < n) {
    const ssize_t w = ::write(2, s + off, n - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    off += static_cast<size_t>(w);
  }
}

void on_signal(int sig, siginfo_t* info, void*) {
  const int saved = errno;
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  const long long now_ms = static_cast<long long>(now.tv_sec) * 1000 + now.tv_nsec / 1000000;
  if (g_requested == 0) {
    g_first_seconds = static_cast<sig_atomic_t>(now.tv_sec);
    g_first_millis = static_cast<sig_atomic_t>(now.tv_nsec / 1000000);
    g_requested = sig;
    if (g_grace_seconds > 0) alarm(g_grace_seconds);
  } else if (!(g_parent_forwards && info && info->si_pid == getppid())) {
    const long long first_ms = static_cast<long long>(g_first_seconds) * 1000 + g_first_millis;
    if (now_ms - first_ms > static_cast<long long>(kSignalRepeatSeconds * 1000)) {
      write_stderr(g_again_message);
      _exit(128 + sig);
    }
  }
  errno = saved;
}

void on_alarm(int) {
  write_stderr(g_deadline_message);
  _exit(128 + (g_requested ? g_requested : SIGALRM));
}

}  // namespace

std::string signal_display_name(int sig) {
  if (const char* abbrev = sigabbrev_np(sig)) return std::string("SIG") + abbrev;
  return "signal " + std::to_string(sig);
}

int preemption_signal_number(const std::string& name) {
  int sig = 0;
  if (!name.empty() && name.find_first_not_of("0123456789") == std::string::npos && name.size() < 4) {
    sig = std::stoi(name);
  } else {
    const std::string bare = name.rfind("SIG", 0) == 0 ? name.substr(3) : name;
    for (int s = 1; s < NSIG; ++s)
      if (const char* abbrev = sigabbrev_np(s); abbrev && bare == abbrev) sig = s;
  }
  TITAN_USER_CHECK(sig > 0 && sig < NSIG && sigabbrev_np(sig), "job.preemption_signals: '", name,
                   "' is not a signal; give names such as \"SIGTERM\" or \"SIGUSR1\"");
  for (int bad : {SIGKILL, SIGSTOP, SIGINT, SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS, SIGALRM, SIGCHLD,
                  SIGPIPE, SIGCONT, SIGTSTP, SIGTTIN, SIGTTOU, SIGWINCH, SIGURG, SIGPROF, SIGVTALRM})
    TITAN_USER_CHECK(sig != bad, "job.preemption_signals: ", signal_display_name(sig),
                     " cannot serve as a preemption notice (it cannot be caught, reports a fault, or titan "
                     "uses it: SIGINT is Ctrl-C and how titan launch stops the workers of a failed job); use SIGTERM, "
                     "SIGUSR1, SIGUSR2, SIGHUP or SIGQUIT");
  return sig;
}

PreemptionHandler::PreemptionHandler(const std::vector<int>& signals, int64_t grace_seconds) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_installed++ > 0) return;  // trainers side by side in one process share the installation
  g_requested = 0;
  g_grace_seconds = static_cast<unsigned>(grace_seconds > 0 ? grace_seconds : 0);
  std::snprintf(g_again_message, sizeof g_again_message,
                "titan: a second preemption signal: exiting now, without the checkpoint of this step "
                "(the previous one is intact)\n");
  std::snprintf(g_deadline_message, sizeof g_deadline_message,
                "titan: the preemption grace period (job.preemption_grace_seconds = %u) ran out before the run "
                "stopped: exiting now (the previous checkpoint is intact)\n",
                g_grace_seconds);
  g_signals = signals;
  g_previous.assign(signals.size(), {});
  g_parent_forwards = std::getenv("TORCHELASTIC_USE_AGENT_STORE") != nullptr;
  struct sigaction sa {};
  sa.sa_sigaction = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int s : signals) sigaddset(&sa.sa_mask, s);  // one handler at a time
  sa.sa_flags = SA_RESTART | SA_SIGINFO;
  for (size_t i = 0; i < signals.size(); ++i) sigaction(signals[i], &sa, &g_previous[i]);
  if (g_grace_seconds > 0) {
    struct sigaction al {};
    al.sa_handler = on_alarm;
    sigemptyset(&al.sa_mask);
    sigaction(SIGALRM, &al, &g_previous_alarm);
  }
}

PreemptionHandler::~PreemptionHandler() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (--g_installed > 0) return;
  if (g_grace_seconds > 0) {
    alarm(0);
    sigaction(SIGALRM, &g_previous_alarm, nullptr);
  }
  for (size_t i = 0; i < g_signals.size(); ++i) sigaction(g_signals[i], &g_previous[i], nullptr);
  g_signals.clear();
  g_requested = 0;
}

int PreemptionHandler::requested() { return g_requested; }

}  // namespace titan
