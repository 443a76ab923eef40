#include "titan/tools/preflight.h"

#include "titan/common/error.h"
#include "titan/components/metrics/memory_monitor.h"
#include "titan/components/metrics/metrics.h"
#include "titan/distributed/runtime.h"
#include "titan/tools/estimate.h"

#include <torch/cuda.h>

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

namespace titan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", static_cast<double>(bytes) / kGiB);
  return buf;
}

// A number from a one-value file (cgroup v2's memory.max / memory.current); -1 when absent or "max".
int64_t read_bytes(const std::string& path) {
  std::ifstream in(path);
  std::string v;
  if (!(in >> v) || v == "max") return -1;
  try {
    return std::stoll(v);
  } catch (const std::exception&) {
    return -1;
  }
}

// The value of `key` in a "key value" file (cgroup v2's memory.stat); -1 when absent.
int64_t stat_value(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string k;
  int64_t v = 0;
  while (in >> k >> v)
    if (k == key) return v;
  return -1;
}

// What this process's cgroup and its ancestors leave to it: the tightest of memory.max (v2) or
// memory.limit_in_bytes (v1) less the memory in use, not counting the page cache that can be dropped
// (inactive_file); -1 without a limit.
int64_t cgroup_headroom() {
  std::ifstream in("/proc/self/cgroup");
  std::string line, path;
  while (std::getline(in, line))
    if (line.rfind("0::", 0) == 0) path = line.substr(3);
  int64_t best = -1;
  for (std::string p = path;; p = p.substr(0, p.rfind('/'))) {
    const std::string dir = "/sys/fs/cgroup" + (p == "/" ? std::string() : p);
    const int64_t limit = read_bytes(dir + "/memory.max"), used = read_bytes(dir + "/memory.current");
    if (limit > 0 && used >= 0) {
      const int64_t cache = std::max<int64_t>(0, stat_value(dir + "/memory.stat", "inactive_file"));
      const int64_t left = std::max<int64_t>(0, limit - std::max<int64_t>(0, used - cache));
      best = best < 0 ? left : std::min(best, left);
    }
    if (p.empty() || p == "/" || p.find('/') == std::string::npos) break;
  }
  // cgroup v1 (its memory controller as mounted for this process; "no limit" is a huge number).
  const std::string v1 = "/sys/fs/cgroup/memory";
  const int64_t limit = read_bytes(v1 + "/memory.limit_in_bytes"), used = read_bytes(v1 + "/memory.usage_in_bytes");
  if (limit > 0 && limit < (int64_t{1} << 60) && used >= 0) {
    const int64_t cache = std::max<int64_t>(0, stat_value(v1 + "/memory.stat", "total_inactive_file"));
    const int64_t left = std::max<int64_t>(0, limit - std::max<int64_t>(0, used - cache));
    best = best < 0 ? left : std::min(best, left);
  }
  return best;
}

int64_t mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return -1;
}

}  // namespace

AvailableMemory available_memory_per_rank(bool cuda, int device, int local_world_size) {
  AvailableMemory a;
  if (cuda) {
    a.bytes = static_cast<int64_t>(metrics::detail::cuda_free_memory(device));
    a.what = "free memory of GPU " + std::to_string(device);  // each rank has its own (local_device_index)
    return a;
  }
  int64_t bytes = mem_available();
  a.what = "the machine's available memory";
  const int64_t headroom = cgroup_headroom();
  if (headroom >= 0 && (bytes < 0 || headroom < bytes)) {
    bytes = headroom;
    a.what = "the memory limit of this process's cgroup, less what it uses beyond reclaimable cache";
  }
  if (local_world_size > 1) a.what += ", shared by the " + std::to_string(local_world_size) + " ranks of this machine";
  a.bytes = bytes < 0 ? 0 : bytes / std::max(1, local_world_size);
  return a;
}

void check_memory_fits(const JobConfig& cfg) {
  // A seed checkpoint only builds and saves the model: the training peak does not apply.
  if (cfg.debug.skip_memory_check || cfg.checkpoint.create_seed_checkpoint) return;
  const dist::LaunchEnv env = dist::launch_env_from_environment();
  const bool cuda = torch::cuda::is_available();
  EstimateOptions o;
  o.world_size = env.world_size;
  o.device = cuda ? "cuda" : "cpu";
  o.other_ac_modes = false;  // one dry run at start-up; the others only for a run that does not fit
  Estimate e;
  try {
    e = estimate(cfg, o);
  } catch (const std::exception& ex) {
    if (env.rank == 0)
      std::cerr << metrics::log_prefix("WARNING") << "the pre-flight memory check was skipped (the dry run failed: "
                << ex.what() << ")" << std::endl;
    return;
  }
  const int device = cuda ? dist::local_device_index(env, static_cast<int>(torch::cuda::device_count()),
                                                    std::getenv("CUDA_VISIBLE_DEVICES") != nullptr)
                          : 0;
  const AvailableMemory a = available_memory_per_rank(cuda, device, env.local_world_size);
  if (a.bytes <= 0 || e.peak_device <= a.bytes) {
    if (env.rank == 0 && a.bytes > 0)
      std::cout << metrics::log_prefix() << "Memory check: `titan estimate` predicts a peak of " << gib(e.peak_device)
                << " per rank; " << gib(a.bytes) << " is available to each (" << a.what << ")" << std::endl;
    return;
  }
  o.other_ac_modes = true;  // what would fit
  e = estimate(cfg, o);
  std::ostringstream msg;
  msg << "this run does not fit in memory: `titan estimate` predicts a peak of " << gib(e.peak_device)
      << " per rank (" << e.layout << ", activation checkpointing " << e.activation_checkpointing << ", local batch "
      << e.local_batch_size << " x seq_len " << cfg.training.seq_len << "), and " << gib(a.bytes)
      << " is available to each rank (" << a.what << ").";
  std::string fitting;
  for (const auto& [mode, peak] : e.peak_by_ac)
    if (peak <= a.bytes && mode != e.activation_checkpointing)
      fitting += std::string(fitting.empty() ? "" : "; ") + "activation checkpointing " + mode + ": " + gib(peak);
  msg << "\n  what would fit: " << (fitting.empty() ? "no activation checkpointing mode alone" : fitting)
      << "; a smaller training.local_batch_size or seq_len lowers the activations ("
      << gib(e.activations) << " here); more ranks shard the parameters, gradients and optimizer state ("
      << gib(e.params + e.grads + e.optimizer) << " here) with FSDP"
      << "\n  run `titan estimate` with the same options to try layouts; --debug.skip_memory_check goes on anyway";
  throw UserError(msg.str());
}

}  // namespace titan
