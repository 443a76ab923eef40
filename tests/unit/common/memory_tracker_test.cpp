// The counting CPU allocator: exact bytes of tensors alive now and at the peak.
#include "titan/common/memory_tracker.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace titan::mem {
namespace {

TEST(MemoryTracker, CountsTensorBytesAliveAndPeak) {
  install_cpu_tracking();
  const int64_t before = cpu_allocated_bytes();
  reset_cpu_peak();
  {
    at::Tensor a = at::empty({1000, 1000}, at::kFloat);  // 4,000,000 bytes
    EXPECT_EQ(cpu_allocated_bytes() - before, 4000000);
    at::Tensor b = at::empty({500}, at::kDouble);  // 4,000 bytes
    EXPECT_EQ(cpu_allocated_bytes() - before, 4004000);
  }
  EXPECT_EQ(cpu_allocated_bytes(), before);
  EXPECT_EQ(cpu_peak_bytes() - before, 4004000);
  reset_cpu_peak();
  EXPECT_EQ(cpu_peak_bytes(), before);
}

TEST(MemoryTracker, PeakScopeSeesTemporariesOfAnExpression) {
  at::Tensor x = at::ones({1 << 20});  // 4 MiB
  PeakScope scope;
  at::Tensor y = (x * 2 + 1).sum();  // x * 2 and + 1 each take 4 MiB (the first freed after the add)
  EXPECT_GE(scope.peak_above_start(), 2 * 4 * (1 << 20));
  EXPECT_LT(scope.peak_above_start(), 3 * 4 * (1 << 20));
}

TEST(MemoryTracker, ThreadsAndViewsCountStorageOnce) {
  install_cpu_tracking();
  const int64_t before = cpu_allocated_bytes();
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([] {
      for (int i = 0; i < 1000; ++i) {
        at::Tensor a = at::empty({256}, at::kFloat);
        at::Tensor v = a.view({16, 16}).t();  // a view shares the storage
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(cpu_allocated_bytes(), before);
  const int64_t count = cpu_allocation_count();
  at::Tensor a = at::empty({256});
  at::Tensor v = a.slice(0, 0, 8);
  EXPECT_EQ(cpu_allocation_count(), count + 1);
}

// oneDNN takes scratch memory through Allocator::raw_allocate, which needs the data pointer to be
// the deleter's context: those bytes are counted too.
TEST(MemoryTracker, RawAllocationsAreCounted) {
  install_cpu_tracking();
  const int64_t before = cpu_allocated_bytes();
  c10::Allocator* a = c10::GetCPUAllocator();
  void* p = a->raw_allocate(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(cpu_allocated_bytes() - before, 1000);
  a->raw_deallocate(p);
  EXPECT_EQ(cpu_allocated_bytes(), before);
}

}  // namespace
}  // namespace titan::mem
