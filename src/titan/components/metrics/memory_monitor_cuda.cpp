// The CUDA part of MemoryMonitor. Built when libtorch's c10_cuda headers and the CUDA runtime
// headers are present (a CUDA build of libtorch); the calls are only made when a GPU is present.
#include "titan/components/metrics/memory_monitor.h"

#include "titan/common/error.h"

#if __has_include(<c10/cuda/CUDACachingAllocator.h>) && __has_include(<cuda_runtime_api.h>)
#define TITAN_METRICS_HAS_CUDA 1
#include <ATen/Context.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#else
#define TITAN_METRICS_HAS_CUDA 0
#endif

namespace titan::metrics::detail {

#if TITAN_METRICS_HAS_CUDA

namespace {
constexpr size_t kAllPools = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);

cudaDeviceProp properties(int index) {
  cudaDeviceProp prop{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  return prop;
}
}  // namespace

int cuda_current_device() { return c10::cuda::current_device(); }

std::string cuda_device_name(int index) { return properties(index).name; }

double cuda_total_memory(int index) { return static_cast<double>(properties(index).totalGlobalMem); }

double cuda_free_memory(int index) {
  int previous = 0;
  C10_CUDA_CHECK(cudaGetDevice(&previous));
  C10_CUDA_CHECK(cudaSetDevice(index));
  size_t free = 0, total = 0;
  const cudaError_t err = cudaMemGetInfo(&free, &total);
  C10_CUDA_CHECK(cudaSetDevice(previous));
  C10_CUDA_CHECK(err);
  return static_cast<double>(free);
}

CudaPeaks cuda_peaks(int index) {
  at::globalContext().lazyInitDevice(c10::kCUDA);  // the allocator's statistics exist once CUDA is initialized
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(index));
  return {stats.active_bytes[kAllPools].peak, stats.reserved_bytes[kAllPools].peak, stats.num_alloc_retries,
          stats.num_ooms};
}

void cuda_reset_peaks(int index) {
  at::globalContext().lazyInitDevice(c10::kCUDA);
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(index));
}

#else

namespace {
[[noreturn]] void no_cuda() {
  throw UserError("this build of titan has no CUDA support: use a CUDA build of libtorch, or train on CPU.");
}
}  // namespace

int cuda_current_device() { no_cuda(); }
std::string cuda_device_name(int) { no_cuda(); }
double cuda_total_memory(int) { no_cuda(); }
double cuda_free_memory(int) { no_cuda(); }
CudaPeaks cuda_peaks(int) { no_cuda(); }
void cuda_reset_peaks(int) { no_cuda(); }

#endif

}  // namespace titan::metrics::detail
