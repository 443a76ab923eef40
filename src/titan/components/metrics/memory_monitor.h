// Peak device memory per log interval, as torchtitan's DeviceMemoryMonitor reports it.
//
// CUDA: the caching allocator's device statistics (peak active and reserved bytes since the last
//   reset, allocation retries, OOMs), as a fraction of the GPU's total memory.
// CPU: the peak bytes of CPU tensor storage (the counting allocator of common/memory_tracker.h,
//   installed by the monitor) as a fraction of the machine's physical memory; "active" and
//   "reserved" are both that figure (nothing is cached), and retries/OOMs do not exist.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>

namespace titan::metrics {

struct MemoryStats {
  double max_active_gib = 0, max_active_pct = 0;
  double max_reserved_gib = 0, max_reserved_pct = 0;
  std::optional<int64_t> num_alloc_retries;  // CUDA only
  std::optional<int64_t> num_ooms;           // CUDA only
};

class MemoryMonitor {
 public:
  // Monitors `device` (CPU, or a CUDA device; a CUDA device without index means the current one)
  // and resets its peak statistics. Throws UserError for a CUDA device when CUDA is unavailable.
  explicit MemoryMonitor(c10::Device device);

  // Peak statistics since construction or the last reset_peak_stats().
  MemoryStats peak_stats() const;

  // Starts a new interval for the peaks.
  void reset_peak_stats();

  // The device's name ("NVIDIA H100 80GB HBM3"; "CPU" for the CPU) and total memory in bytes.
  const std::string& device_name() const { return device_name_; }
  double capacity_bytes() const { return capacity_bytes_; }
  bool is_cuda() const { return device_.is_cuda(); }

 private:
  c10::Device device_;
  std::string device_name_;
  double capacity_bytes_ = 0;
};

namespace detail {
// CUDA side (memory_monitor_cuda.cpp): compiled against c10_cuda when the headers exist.
struct CudaPeaks {
  int64_t active_bytes = 0, reserved_bytes = 0, num_alloc_retries = 0, num_ooms = 0;
};
int cuda_current_device();
std::string cuda_device_name(int index);
double cuda_total_memory(int index);
double cuda_free_memory(int index);  // cudaMemGetInfo on that device
CudaPeaks cuda_peaks(int index);
void cuda_reset_peaks(int index);
}  // namespace detail

}  // namespace titan::metrics
