// Profiler traces and memory snapshots at chosen steps ([profiling] in the config), as torchtitan's
// profiler does.
//
// Traces: Kineto (PyTorch's profiler) records CPU operators, named ranges (TraceRange: forward,
// backward, optimizer, data_loading, every collective by mesh dimension, every FSDP unit's all-gather
// and reduce-scatter) and, on CUDA, kernels and memory copies. With profile_freq F, warmup W and
// active A, every cycle of F steps ends with A recorded steps after W warm-up steps (torch.profiler's
// schedule(wait = F - W - A, warmup = W, active = A)): the steps s with (s - 1) mod F >= F - A are
// recorded, and the trace of a cycle is written after its last step s as
//   <traces_dir>/iteration_<s>/rank<R>_trace.json      (Chrome trace JSON: Perfetto, chrome://tracing)
// The schedule counts absolute steps, so a resumed run keeps the cycle of the run it continues. A run
// that ends inside a recorded window writes what it recorded (as torch.profiler does on exit).
//
// Memory snapshots, every snapshot_freq steps (after step s with s mod snapshot_freq == 0):
//   <snapshot_dir>/iteration_<s>/rank<R>_memory_snapshot.pickle   CUDA: pytorch.org/memory_viz reads it
//   <snapshot_dir>/iteration_<s>/rank<R>_cpu_memory.txt (.json)    CPU: the peak breakdown by phase
// and, when an out-of-memory error ends the run, the same under iteration_<s>_exit (s: the step that
// failed).
#pragma once

#include "titan/config/sections_run.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace titan::metrics {

struct ProfilerOptions {
  bool traces = false;              // [profiling] enable_profiling
  std::string traces_dir;           // <dump_folder>/<save_traces_folder>
  int64_t freq = 10;                // profile_freq
  int64_t warmup = 3;               // profiler_warmup
  int64_t active = 1;               // profiler_active
  bool memory_snapshots = false;    // enable_memory_snapshot
  std::string snapshot_dir;         // <dump_folder>/<save_memory_snapshot_folder>
  int64_t snapshot_freq = 10;       // profile_freq
  size_t snapshot_max_entries = 100000;  // CUDA history kept (alloc/free events)
  int rank = 0;
  c10::Device device = c10::Device(c10::kCPU);
  std::function<void(const std::string&)> log;  // where progress lines go (rank 0's log); may be empty
};

// The [profiling] section's options (folders under the job's dump folder), or none when neither
// traces nor memory snapshots are on; the trainer adds rank, device and the log.
std::optional<ProfilerOptions> profiler_options(const config::Profiling& section, const config::Job& job);

class Profiler {
 public:
  // Validates the options (freq >= warmup + active, ...) and, for CUDA snapshots, starts recording
  // the allocator's history.
  explicit Profiler(ProfilerOptions options);
  ~Profiler();  // stops a recording in progress (without writing it) and the CUDA history
  Profiler(const Profiler&) = delete;
  Profiler& operator=(const Profiler&) = delete;

  // Call before training step `step` (1-based) starts, and after it ends (its update, log line and
  // evaluation done): a recorded window that ends with `step` is written.
  void step_begin(int64_t step);
  void step_end(int64_t step);
  // Call right after step `step`'s update, before the metrics log resets the peaks: the memory
  // snapshot of the steps that take one.
  void snapshot_step(int64_t step);
  // Writes a window still recording (the run ended inside it) as iteration_<last_step>.
  void finish(int64_t last_step);
  // After an out-of-memory error at `step`: writes the memory snapshot(s) under iteration_<step>_exit
  // and returns the path of the main file ("" when memory snapshots are off or writing failed).
  std::string write_oom_snapshot(int64_t step) noexcept;

  // Whether step `step` is recorded / warms up under the schedule.
  bool records(int64_t step) const;
  bool warms_up(int64_t step) const;
  // The trace file of the window that ends with step `step`.
  std::string trace_path(int64_t step) const;

 private:
  void start(bool record);
  void stop_and_save(int64_t step);
  void write_snapshot(const std::string& folder, int64_t step);

  ProfilerOptions options_;
  enum class State { Off, Prepared, Recording } state_ = State::Off;
  struct StepRange;
  std::unique_ptr<StepRange> step_range_;  // "ProfilerStep#N" while a recorded step runs
  bool cuda_history_ = false;
};

}  // namespace titan::metrics
