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

struct Block {
  void* data;
  int64_t bytes;
};

void raise_peak(int64_t now) {
  int64_t peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void free_block(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  g_current.fetch_sub(b->bytes, std::memory_order_relaxed);
  c10::free_cpu(b->data);
  delete b;
}

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    void* data = c10::alloc_cpu(n);  // throws (with the size) when the system is out of memory
    auto* b = new Block{data, static_cast<int64_t>(n)};
    g_count.fetch_add(1, std::memory_order_relaxed);
    raise_peak(g_current.fetch_add(b->bytes, std::memory_order_relaxed) + b->bytes);
    return {data, b, &free_block, c10::Device(c10::DeviceType::CPU)};
  }
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
