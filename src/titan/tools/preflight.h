// The pre-flight memory check of `titan train`: before the model is built, the per-rank peak that
// `titan estimate` predicts for the run (its dry run on the meta device) is compared with the memory
// this rank can have, and a run that cannot fit stops with both figures and the options that would
// fit, instead of being killed by the kernel or the allocator partway into its build or first step.
#pragma once

#include "titan/config/job_config.h"

#include <cstdint>
#include <string>

namespace titan {

// The memory one rank can use: the free memory of its GPU, or on the CPU the machine's available
// memory (MemAvailable, and the cgroup's limit less its usage when one is set), shared by the
// node's ranks.
struct AvailableMemory {
  int64_t bytes = 0;
  std::string what;  // where the figure comes from, for the message
};
AvailableMemory available_memory_per_rank(bool cuda, int device, int local_world_size);

// Throws UserError when the run's estimated per-rank peak exceeds available_memory_per_rank: the
// message gives both, the activation checkpointing modes that would fit, and how to go on anyway
// (debug.skip_memory_check). Nothing with debug.skip_memory_check. A config the estimator cannot
// dry-run is left to the trainer (a warning says the check was skipped).
void check_memory_fits(const JobConfig& cfg);

}  // namespace titan
