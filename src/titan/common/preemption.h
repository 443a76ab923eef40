// Preemption notices. Clusters send SIGTERM (or the signal chosen with SLURM's --signal=SIG@seconds;
// Kubernetes sends SIGTERM) a grace period before they kill a job. While a PreemptionHandler lives,
// the first such signal only records a request: the trainer finishes the step in flight, the ranks
// agree on the step to stop at, a checkpoint of it is saved and the process exits with
// kExitPreempted (trainer.cpp). A second signal exits at once, as does the end of an optional
// grace deadline; the previous checkpoint stays intact either way (saves become visible by a rename).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace titan {

// The signal number of "SIGTERM", "TERM" or "15". Throws UserError for an unknown name or a signal
// that cannot or must not be handled (SIGKILL, SIGSTOP, the fault signals, SIGALRM, SIGCHLD, ...).
int preemption_signal_number(const std::string& name);
// "SIGTERM" for SIGTERM.
std::string signal_display_name(int sig);

// A repeat of a signal this soon after the first (seconds) is the same notice delivered twice (the
// scheduler signals every process of the job, and `titan launch` forwards what it receives), not a
// second signal.
constexpr double kSignalRepeatSeconds = 2.0;

class PreemptionHandler {
 public:
  // Handles `signals` (numbers) for the object's lifetime; the previous handlers come back after.
  // grace_seconds > 0: that many seconds after the first signal the process exits at once
  // (code 128 + the signal) with a line on stderr. Handlers in one process share one installation.
  PreemptionHandler(const std::vector<int>& signals, int64_t grace_seconds);
  ~PreemptionHandler();
  PreemptionHandler(const PreemptionHandler&) = delete;
  PreemptionHandler& operator=(const PreemptionHandler&) = delete;

  // The first signal received (0: none yet).
  static int requested();
};

}  // namespace titan
