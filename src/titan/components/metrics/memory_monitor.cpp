#include "titan/components/metrics/memory_monitor.h"

#include "titan/common/error.h"
#include "titan/common/memory_tracker.h"

#include <torch/cuda.h>
#include <unistd.h>


namespace titan::metrics {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

double physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page_size > 0 ? static_cast<double>(pages) * static_cast<double>(page_size) : 0;
}

double pct(double bytes, double capacity) { return capacity > 0 ? 100.0 * bytes / capacity : 0; }

}  // namespace

MemoryMonitor::MemoryMonitor(c10::Device device) : device_(device) {
  TITAN_USER_CHECK(device_.is_cpu() || device_.is_cuda(), "metrics: memory monitoring supports cpu and cuda devices, not ",
                   device_.str(), ".");
  if (device_.is_cuda()) {
    TITAN_USER_CHECK(torch::cuda::is_available(), "metrics: device ", device_.str(),
                     " was requested but CUDA is not available on this machine (no GPU or driver). Train on cpu.");
    if (!device_.has_index()) device_.set_index(static_cast<c10::DeviceIndex>(detail::cuda_current_device()));
    device_name_ = detail::cuda_device_name(device_.index());
    capacity_bytes_ = detail::cuda_total_memory(device_.index());
  } else {
    device_name_ = "CPU";
    capacity_bytes_ = physical_memory_bytes();
    mem::install_cpu_tracking();
  }
  reset_peak_stats();
}

MemoryStats MemoryMonitor::peak_stats() const {
  MemoryStats s;
  if (device_.is_cuda()) {
    const detail::CudaPeaks peaks = detail::cuda_peaks(device_.index());
    s.max_active_gib = peaks.active_bytes / kGiB;
    s.max_active_pct = pct(peaks.active_bytes, capacity_bytes_);
    s.max_reserved_gib = peaks.reserved_bytes / kGiB;
    s.max_reserved_pct = pct(peaks.reserved_bytes, capacity_bytes_);
    s.num_alloc_retries = peaks.num_alloc_retries;
    s.num_ooms = peaks.num_ooms;
  } else {
    // No cache on CPU: what the allocator holds is what tensors use.
    const double peak = static_cast<double>(mem::cpu_peak_bytes());
    s.max_active_gib = s.max_reserved_gib = peak / kGiB;
    s.max_active_pct = s.max_reserved_pct = pct(peak, capacity_bytes_);
  }
  return s;
}

void MemoryMonitor::reset_peak_stats() {
  if (device_.is_cuda()) {
    detail::cuda_reset_peaks(device_.index());
  } else {
    mem::reset_cpu_peak();
  }
}

}  // namespace titan::metrics
