#include "titan/common/fault_injection.h"

#include "titan/common/error.h"

#include <c10/util/Exception.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace titan::fault {
namespace {

struct Fault {
  std::string action, point;
  int64_t step = -1;
  int rank = 0;      // -1: any
  int attempt = 0;   // -1: any
  int seconds = 5;   // sleep
};

int env_int(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : 0;
}

std::vector<Fault> parse(const std::string& spec) {
  static const std::set<std::string> actions = {"kill", "stop", "nan", "oom", "term", "sleep"};
  static const std::set<std::string> points = {"data",   "forward",         "loss",
                                               "backward", "optimizer",     "checkpoint_data",
                                               "checkpoint_index", "checkpoint_rename"};
  const std::string usage =
      "; expected entries like action=kill,point=backward,step=3,rank=1 separated by ';' "
      "(see docs/reliability.md)";
  std::vector<Fault> out;
  std::stringstream entries(spec);
  for (std::string entry; std::getline(entries, entry, ';');) {
    if (entry.empty()) continue;
    Fault f;
    bool have_step = false;
    std::stringstream kvs(entry);
    for (std::string kv; std::getline(kvs, kv, ',');) {
      const size_t eq = kv.find('=');
      TITAN_USER_CHECK(eq != std::string::npos, "TITAN_FAULT_INJECT: '", kv, "' is not key=value", usage);
      const std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
      auto number = [&](bool any_allowed) {
        if (any_allowed && v == "any") return -1;
        TITAN_USER_CHECK(!v.empty() && v.find_first_not_of("0123456789") == std::string::npos && v.size() < 10,
                         "TITAN_FAULT_INJECT: ", k, "=", v, " is not a non-negative integer",
                         any_allowed ? " or 'any'" : "", usage);
        return std::stoi(v);
      };
      if (k == "action") {
        TITAN_USER_CHECK(actions.count(v), "TITAN_FAULT_INJECT: unknown action '", v, "' (kill, stop, nan, oom, term or sleep)", usage);
        f.action = v;
      } else if (k == "point") {
        TITAN_USER_CHECK(points.count(v), "TITAN_FAULT_INJECT: unknown point '", v,
                         "' (data, forward, loss, backward, optimizer, checkpoint_data, checkpoint_index, "
                         "checkpoint_rename)", usage);
        f.point = v;
      } else if (k == "step") {
        f.step = number(false);
        have_step = true;
      } else if (k == "rank") {
        f.rank = number(true);
      } else if (k == "attempt") {
        f.attempt = number(true);
      } else if (k == "seconds") {
        f.seconds = number(false);
      } else {
        TITAN_USER_CHECK(false, "TITAN_FAULT_INJECT: unknown key '", k, "' (action, point, step, rank, attempt, seconds)", usage);
      }
    }
    TITAN_USER_CHECK(!f.action.empty() && have_step, "TITAN_FAULT_INJECT: '", entry, "' needs action and step", usage);
    if (f.action == "nan") {
      TITAN_USER_CHECK(f.point.empty() || f.point == "loss", "TITAN_FAULT_INJECT: action nan applies at point loss");
      f.point = "loss";
    }
    TITAN_USER_CHECK(!f.point.empty(), "TITAN_FAULT_INJECT: '", entry, "' needs a point", usage);
    out.push_back(f);
  }
  return out;
}

// The faults of this rank and attempt, parsed again whenever the variable changes (tests set it).
struct Plan {
  std::mutex mutex;
  std::string spec;
  std::vector<Fault> mine;
};

std::vector<Fault> plan() {
  static Plan p;
  const char* env = std::getenv("TITAN_FAULT_INJECT");
  const std::string spec = env ? env : "";
  std::lock_guard<std::mutex> lock(p.mutex);  // the checkpoint points may fire in a background thread
  if (spec != p.spec) {
    std::vector<Fault> kept;
    const int rank = env_int("RANK"), attempt = env_int("TORCHELASTIC_RESTART_COUNT");
    for (const Fault& f : parse(spec))
      if ((f.rank < 0 || f.rank == rank) && (f.attempt < 0 || f.attempt == attempt)) kept.push_back(f);
    p.mine = std::move(kept);
    p.spec = spec;
  }
  return p.mine;
}

std::optional<Fault> find(const char* point, int64_t step) {
  for (const Fault& f : plan())
    if (f.step == step && f.point == point) return f;
  return std::nullopt;
}

std::vector<Fault> find_all(const char* point, int64_t step) {
  std::vector<Fault> out;
  for (const Fault& f : plan())
    if (f.step == step && f.point == point) out.push_back(f);
  return out;
}

}  // namespace

void check_environment() { (void)plan(); }

bool enabled() { return !plan().empty(); }

void point(const char* name, int64_t step) {
  const char* env = std::getenv("TITAN_FAULT_INJECT");
  if (!env || !*env) return;
  for (const Fault& f : find_all(name, step)) {  // in the order given
    if (f.action == "nan") continue;
    if (f.action == "oom") {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory (fault injection at ", name, " of step ", step,
                       ": TITAN_FAULT_INJECT)");
    }
    if (f.action == "sleep") {
      std::fprintf(stderr, "fault injection: rank %d sleeps %d s at %s of step %lld\n", env_int("RANK"), f.seconds, name,
                   static_cast<long long>(step));
      std::fflush(stderr);
      unsigned left = static_cast<unsigned>(f.seconds);
      while (left > 0) left = ::sleep(left);  // a handled signal interrupts it: the sleep goes on
      continue;
    }
    const int sig = f.action == "kill" ? SIGKILL : f.action == "stop" ? SIGSTOP : SIGTERM;
    std::fprintf(stderr, "fault injection: rank %d sends itself %s at %s of step %lld\n", env_int("RANK"),
                 sig == SIGKILL ? "SIGKILL" : sig == SIGSTOP ? "SIGSTOP" : "SIGTERM", name, static_cast<long long>(step));
    std::fflush(stderr);
    std::fflush(stdout);
    if (sig == SIGTERM)
      ::raise(sig);  // handled in this thread before raise returns (a preemption notice at this point)
    else
      ::kill(::getpid(), sig);
  }
}

bool nan_loss(int64_t step) {
  const char* env = std::getenv("TITAN_FAULT_INJECT");
  if (!env || !*env) return false;
  const auto f = find("loss", step);
  return f && f->action == "nan";
}

}  // namespace titan::fault
