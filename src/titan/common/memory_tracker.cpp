#include "titan/common/memory_tracker.h"

#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace titan::mem {
namespace {

std::atomic<int64_t> g_current{0}, g_peak{0}, g_count{0};
std::atomic<bool> g_installed{false};

// Each allocation carries its size in a header of one alignment unit before the data, so that the
// data pointer is also the deleter's context (Allocator::raw_allocate, used by oneDNN, needs that).
constexpr size_t kHeader = 64;  // c10's CPU alignment: the data stays aligned like the default allocator's

void raise_peak(int64_t now) {
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void free_counted(void* data) {
  if (!data) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t bytes = 0;
  std::memcpy(&bytes, base, sizeof bytes);
  g_current.fetch_sub(bytes, std::memory_order_relaxed);
  c10::free_cpu(base);
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    char* base = static_cast<char*>(c10::alloc_cpu(n + kHeader));  // throws (with the size) when out of memory
    const int64_t bytes = static_cast<int64_t>(n);
    std::memcpy(base, &bytes, sizeof bytes);
    void* data = base + kHeader;
    g_count.fetch_add(1, std::memory_order_relaxed);
    raise_peak(g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes);
    return {data, data, &free_counted, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_counted; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count) std::memcpy(dest, src, count);
  }
};

}  // namespace

void install_cpu_tracking() {
  static std::once_flag once;
  std::call_once(once, [] {
    static CountingAllocator allocator;
    c10::SetAllocator(c10::DeviceType::CPU, &allocator, /*priority=*/100);
    g_installed = true;
  });
}

bool cpu_tracking_installed() { return g_installed.load(); }
int64_t cpu_allocated_bytes() { return g_current.load(std::memory_order_relaxed); }
int64_t cpu_peak_bytes() { return g_peak.load(std::memory_order_relaxed); }
void reset_cpu_peak() { g_peak.store(g_current.load(std::memory_order_relaxed), std::memory_order_relaxed); }
int64_t cpu_allocation_count() { return g_count.load(std::memory_order_relaxed); }

PeakScope::PeakScope() {
  install_cpu_tracking();
  reset_cpu_peak();
  start_ = cpu_allocated_bytes();
}

int64_t PeakScope::peak_above_start() const { return cpu_peak_bytes() - start_; }

}  // namespace titan::mem
