// Two tiers of errors (see docs/): user errors and internal invariants.
//
//   TITAN_USER_CHECK(cond, msg...)  bad input (config, files, data, launch environment): throws
//                                   titan::UserError whose message says what is wrong and what to do.
//   TITAN_ASSERT(cond, msg...)      an invariant of titan itself: throws titan::InternalError with
//                                   file:line, since it means a bug, not a user mistake.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace titan {

struct UserError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A run stopped because training itself went wrong (a non-finite loss under training.nan_policy =
// stop): the process exits with kExitStopped, which `titan launch --max-restarts` does not restart,
// since the same checkpoint and data would lead to the same step again.
struct RunStopped : UserError {
  using UserError::UserError;
};
constexpr int kExitStopped = 65;  // sysexits' EX_DATAERR

// A start that cannot form one job (ranks given different world sizes, a rank started twice, a rank
// started again on the store of a start that already ran): the process exits with
// kExitLaunchRefused, which `titan launch --max-restarts` does not restart, since the same launch
// would be refused again.
struct LaunchRefused : UserError {
  using UserError::UserError;
};
constexpr int kExitLaunchRefused = 78;  // sysexits' EX_CONFIG

// A run that stopped on a preemption signal (job.preemption_signals) after the step all ranks agreed
// on, with its checkpoint saved when checkpointing is on: the process exits with kExitPreempted,
// which `titan launch --max-restarts` does not count as a failure. Rank 0 has logged what happened.
struct Preempted : std::runtime_error {
  using std::runtime_error::runtime_error;
};
constexpr int kExitPreempted = 75;  // sysexits' EX_TEMPFAIL: run the same command again to resume

struct InternalError : std::logic_error {
  using std::logic_error::logic_error;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace titan

#define TITAN_USER_CHECK(cond, ...)                                   \
  do {                                                                \
    if (!(cond)) throw ::titan::UserError(::titan::detail::concat(__VA_ARGS__)); \
  } while (0)

#define TITAN_ASSERT(cond, ...)                                                          \
  do {                                                                                   \
    if (!(cond))                                                                         \
      throw ::titan::InternalError(::titan::detail::concat(                              \
          __FILE__, ":", __LINE__, ": internal error: ", #cond, " failed. " __VA_OPT__(,) \
          __VA_ARGS__));                                                                 \
  } while (0)
