#include "titan/components/metrics/profiler.h"

#include "titan/common/error.h"
#include "titan/common/memory_snapshot.h"

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <set>

namespace titan::metrics {

std::optional<ProfilerOptions> profiler_options(const config::Profiling& pr, const config::Job& job) {
  if (!pr.enable_profiling && !pr.enable_memory_snapshot) return std::nullopt;
  ProfilerOptions po;
  po.traces = pr.enable_profiling;
  po.traces_dir = (std::filesystem::path(job.dump_folder) / pr.save_traces_folder).string();
  po.freq = pr.profile_freq;
  po.warmup = pr.profiler_warmup;
  po.active = pr.profiler_active;
  po.memory_snapshots = pr.enable_memory_snapshot;
  po.snapshot_dir = (std::filesystem::path(job.dump_folder) / pr.save_memory_snapshot_folder).string();
  po.snapshot_freq = pr.profile_freq;
  return po;
}
namespace fs = std::filesystem;
namespace kineto = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

struct Profiler::StepRange {
  at::RecordFunction record{at::RecordScope::USER_SCOPE};
};

namespace {

// CPU operators with their input shapes (torchtitan records shapes), and on CUDA the device's
// kernels and copies.
ProfilerConfig trace_config() { return ProfilerConfig(ProfilerState::KINETO, /*report_input_shapes=*/true); }

std::set<ActivityType> activities(const c10::Device& device) {
  std::set<ActivityType> a{ActivityType::CPU};
  if (device.is_cuda()) a.insert(ActivityType::CUDA);
  return a;
}

std::string seconds_since(std::chrono::steady_clock::time_point start) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return buf;
}

}  // namespace

Profiler::Profiler(ProfilerOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  TITAN_USER_CHECK(o.freq > 0, "profiling.profile_freq must be positive, got ", o.freq);
  TITAN_USER_CHECK(o.active > 0, "profiling.profiler_active must be positive, got ", o.active);
  TITAN_USER_CHECK(o.warmup >= 0, "profiling.profiler_warmup must not be negative, got ", o.warmup);
  TITAN_USER_CHECK(!o.traces || o.freq >= o.warmup + o.active, "profiling.profile_freq (", o.freq,
                   ") must be at least profiler_warmup + profiler_active (", o.warmup, " + ", o.active,
                   "): every cycle of profile_freq steps ends with the warm-up and the recorded steps");
  TITAN_USER_CHECK(!o.memory_snapshots || o.snapshot_freq > 0, "profiling.profile_freq must be positive, got ",
                   o.snapshot_freq);
  if (o.traces) {
    TITAN_USER_CHECK(kineto::isProfilerEnabledInMainThread() == false,
                     "a profiler is already recording in this process: titan's [profiling] traces need it off");
    fs::create_directories(o.traces_dir);
    if (o.log) o.log("Profiling active. Traces will be saved at " + o.traces_dir);
  }
  if (o.memory_snapshots) {
    fs::create_directories(o.snapshot_dir);
    if (o.device.is_cuda()) {
      mem::start_cuda_memory_history(o.snapshot_max_entries);
      cuda_history_ = true;
    }
    if (o.log) o.log("Memory profiler active. Snapshot will be saved at " + o.snapshot_dir);
  }
}

Profiler::~Profiler() {
  step_range_.reset();
  if (state_ != State::Off) {
    try {
      kineto::disableProfiler();  // the recording is dropped
    } catch (...) {
    }
  }
  if (cuda_history_) {
    try {
      mem::stop_cuda_memory_history();
    } catch (...) {
    }
  }
}

bool Profiler::records(int64_t step) const {
  return options_.traces && step >= 1 && (step - 1) % options_.freq >= options_.freq - options_.active;
}

bool Profiler::warms_up(int64_t step) const {
  if (!options_.traces || step < 1) return false;
  const int64_t m = (step - 1) % options_.freq;
  return m >= options_.freq - options_.active - options_.warmup && m < options_.freq - options_.active;
}

std::string Profiler::trace_path(int64_t step) const {
  return (fs::path(options_.traces_dir) / ("iteration_" + std::to_string(step)) /
          ("rank" + std::to_string(options_.rank) + "_trace.json"))
      .string();
}

void Profiler::start(bool record) {
  if (state_ == State::Off) {
    kineto::prepareProfiler(trace_config(), activities(options_.device));  // the warm-up: Kineto set up, nothing kept
    state_ = State::Prepared;
  }
  if (record && state_ == State::Prepared) {
    kineto::enableProfiler(trace_config(), activities(options_.device));
    state_ = State::Recording;
  }
}

void Profiler::step_begin(int64_t step) {
  if (records(step)) {
    start(/*record=*/true);
    step_range_ = std::make_unique<StepRange>();
    if (step_range_->record.isActive()) step_range_->record.before("ProfilerStep#" + std::to_string(step));
  } else if (warms_up(step)) {
    start(/*record=*/false);
  }
}

void Profiler::stop_and_save(int64_t step) {
  step_range_.reset();
  const auto begin = std::chrono::steady_clock::now();
  if (options_.log) options_.log("Dumping profiler traces at step " + std::to_string(step));
  std::unique_ptr<kineto::ProfilerResult> result = kineto::disableProfiler();
  state_ = State::Off;
  const std::string path = trace_path(step);
  fs::create_directories(fs::path(path).parent_path());
  const std::string tmp = path + ".tmp";
  result->save(tmp);
  TITAN_USER_CHECK(fs::exists(tmp), "writing the profiler trace ", path, " failed: check that ", options_.traces_dir,
                   " is writable");
  fs::rename(tmp, path);
  if (options_.log) options_.log("Finished dumping profiler traces in " + seconds_since(begin) + " seconds");
}

void Profiler::step_end(int64_t step) {
  step_range_.reset();
  if (state_ == State::Recording && (step % options_.freq == 0)) stop_and_save(step);
}

void Profiler::snapshot_step(int64_t step) {
  if (options_.memory_snapshots && step % options_.snapshot_freq == 0)
    write_snapshot("iteration_" + std::to_string(step), step);
}

void Profiler::finish(int64_t last_step) {
  if (state_ == State::Recording) stop_and_save(last_step);
}

void Profiler::write_snapshot(const std::string& folder, int64_t step) {
  const auto begin = std::chrono::steady_clock::now();
  if (options_.log) options_.log("Dumping memory snapshot at step " + std::to_string(step));
  const fs::path dir = fs::path(options_.snapshot_dir) / folder;
  const std::string rank = "rank" + std::to_string(options_.rank);
  if (cuda_history_) mem::write_cuda_memory_snapshot((dir / (rank + "_memory_snapshot.pickle")).string());
  mem::write_cpu_memory_breakdown((dir / (rank + "_cpu_memory.txt")).string(), step);
  if (options_.log) options_.log("Finished dumping memory snapshot in " + seconds_since(begin) + " seconds");
}

std::string Profiler::write_oom_snapshot(int64_t step) noexcept {
  if (!options_.memory_snapshots) return "";
  try {
    const std::string folder = "iteration_" + std::to_string(step) + "_exit";
    write_snapshot(folder, step);
    const fs::path dir = fs::path(options_.snapshot_dir) / folder;
    const std::string rank = "rank" + std::to_string(options_.rank);
    return (dir / (rank + (cuda_history_ ? "_memory_snapshot.pickle" : "_cpu_memory.txt"))).string();
  } catch (const std::exception& e) {
    std::cerr << "titan: writing the memory snapshot after the out-of-memory error failed: " << e.what() << std::endl;
    return "";
  }
}

}  // namespace titan::metrics
