// The counting CPU allocator: exact bytes of tensors alive now and at the peak, and the peak's
// breakdown by the phase that allocated the bytes.
#include "titan/common/memory_tracker.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <mutex>
#include <optional>
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

// ---------------------------------------------------------------------------------------------
// The peak's breakdown by allocating phase.

size_t idx(Phase p) { return static_cast<size_t>(p); }

int64_t sum(const std::array<int64_t, kPhases>& parts) {
  int64_t total = 0;
  for (int64_t v : parts) total += v;
  return total;
}

// A step in miniature: parameters at setup, activations kept by forward, a collective's buffer
// freed inside forward, gradients and a temporary in backward. The peak is in backward and its
// parts are exact, counted from the bytes alive per phase when the window started.
TEST(MemoryBreakdown, PartsOfThePeakAreTheBytesEachPhaseAllocated) {
  install_cpu_tracking();
  reset_cpu_peak();
  const PeakBreakdown start = cpu_peak_breakdown();
  EXPECT_EQ(start.peak_bytes, cpu_allocated_bytes());
  auto grown = [&](const PeakBreakdown& b, Phase p) { return b.alive_by_phase[idx(p)] - start.alive_by_phase[idx(p)]; };

  at::Tensor params, activations;
  {
    PhaseScope setup(Phase::Setup);
    params = at::empty({1000}, at::kFloat);  // 4,000 bytes
  }
  {
    PhaseScope forward(Phase::Forward);
    activations = at::empty({2000}, at::kFloat);  // 8,000 bytes
    {
      PhaseScope communication(Phase::Communication);
      at::Tensor gathered = at::empty({500}, at::kFloat);  // 2,000 bytes, freed at the end of the scope
      EXPECT_EQ(current_phase(), Phase::Communication);
    }
    EXPECT_EQ(current_phase(), Phase::Forward);  // the inner scope restored the outer phase
  }
  EXPECT_EQ(current_phase(), Phase::Other);
  PeakBreakdown b = cpu_peak_breakdown();  // 14,000 bytes, reached while the buffer was alive
  EXPECT_EQ(b.peak_bytes - start.peak_bytes, 14000);
  EXPECT_EQ(grown(b, Phase::Communication), 2000);
  EXPECT_EQ(b.phase_at_peak, Phase::Communication);
  {
    PhaseScope backward(Phase::Backward);
    at::Tensor grads = at::empty({1000}, at::kFloat);  // 4,000 bytes
    at::Tensor temp = at::empty({1500}, at::kFloat);   // 6,000 bytes: 22,000 alive
  }
  b = cpu_peak_breakdown();
  EXPECT_EQ(b.peak_bytes - start.peak_bytes, 22000);
  EXPECT_EQ(grown(b, Phase::Setup), 4000);
  EXPECT_EQ(grown(b, Phase::Forward), 8000);
  EXPECT_EQ(grown(b, Phase::Backward), 10000);
  EXPECT_EQ(grown(b, Phase::Communication), 0);  // its buffer was freed before this peak
  EXPECT_EQ(grown(b, Phase::Other), 0);
  EXPECT_EQ(b.phase_at_peak, Phase::Backward);
  EXPECT_EQ(sum(b.alive_by_phase), b.peak_bytes);

  // Below the peak nothing changes; above it, a new breakdown.
  activations.reset();  // the parameters alone: 4,000 alive
  at::Tensor state;
  {
    PhaseScope optimizer(Phase::Optimizer);
    { at::Tensor below = at::empty({4500}, at::kFloat); }  // 22,000 alive: not above the peak
    EXPECT_EQ(cpu_peak_breakdown().alive_by_phase, b.alive_by_phase);
    EXPECT_EQ(cpu_peak_breakdown().phase_at_peak, Phase::Backward);
    state = at::empty({5000}, at::kFloat);  // 20,000 bytes: 24,000 alive
  }
  b = cpu_peak_breakdown();
  EXPECT_EQ(b.peak_bytes - start.peak_bytes, 24000);
  EXPECT_EQ(grown(b, Phase::Setup), 4000);
  EXPECT_EQ(grown(b, Phase::Forward), 0);
  EXPECT_EQ(grown(b, Phase::Optimizer), 20000);
  EXPECT_EQ(b.phase_at_peak, Phase::Optimizer);
  EXPECT_EQ(sum(b.alive_by_phase), b.peak_bytes);
}

TEST(MemoryBreakdown, ResetStartsFromTheBytesAliveNow) {
  install_cpu_tracking();
  at::Tensor batch;
  {
    PhaseScope data(Phase::Data);
    batch = at::empty({256}, at::kFloat);
  }
  {
    PhaseScope forward(Phase::Forward);
    at::Tensor transient = at::empty({100000}, at::kFloat);
  }
  {
    PhaseScope validation(Phase::Validation);
    reset_cpu_peak();
  }
  const PeakBreakdown b = cpu_peak_breakdown();
  EXPECT_EQ(b.peak_bytes, cpu_allocated_bytes());
  EXPECT_EQ(b.peak_bytes, cpu_peak_bytes());
  EXPECT_EQ(b.alive_by_phase, cpu_allocated_bytes_by_phase());
  EXPECT_EQ(b.phase_at_peak, Phase::Validation);  // the resetting thread's phase
  EXPECT_EQ(sum(b.alive_by_phase), b.peak_bytes);
}

TEST(MemoryBreakdown, AFreeCountsAgainstThePhaseThatAllocated) {
  install_cpu_tracking();
  const auto before = cpu_allocated_bytes_by_phase();
  at::Tensor activation, batch;
  {
    PhaseScope forward(Phase::Forward);
    activation = at::empty({1000}, at::kFloat);
  }
  {
    PhaseScope data(Phase::Data);
    batch = at::empty({300}, at::kFloat);
  }
  auto now = cpu_allocated_bytes_by_phase();
  EXPECT_EQ(now[idx(Phase::Forward)] - before[idx(Phase::Forward)], 4000);
  EXPECT_EQ(now[idx(Phase::Data)] - before[idx(Phase::Data)], 1200);
  {
    PhaseScope backward(Phase::Backward);
    activation.reset();  // freed during backward, allocated during forward
  }
  // Freed by another thread, in yet another phase.
  std::thread([&] {
    PhaseScope checkpoint(Phase::Checkpoint);
    batch.reset();
  }).join();
  EXPECT_EQ(cpu_allocated_bytes_by_phase(), before);
}

TEST(MemoryBreakdown, PhasesAreThreadLocal) {
  PhaseScope forward(Phase::Forward);
  Phase seen = Phase::Setup;
  std::thread([&] { seen = current_phase(); }).join();
  EXPECT_EQ(seen, Phase::Other);
  EXPECT_EQ(current_phase(), Phase::Forward);
}

// Threads allocate and free under different phases, hand tensors to each other to free, while
// another thread takes breakdowns and resets the peak: no crash, no negative part, and the counters
// return exactly to where they started.
TEST(MemoryBreakdown, ConcurrentAllocationIsSafeAndBalanced) {
  install_cpu_tracking();
  const int64_t before = cpu_allocated_bytes();
  const auto before_by_phase = cpu_allocated_bytes_by_phase();
  std::atomic<bool> stop{false}, negative{false};
  std::atomic<int64_t> breakdowns{0};
  std::thread reader([&] {
    while (!stop.load()) {
      const PeakBreakdown b = cpu_peak_breakdown();
      for (int64_t v : b.alive_by_phase)
        if (v < 0) negative = true;
      if (b.peak_bytes < 0 || format_breakdown(b).empty()) negative = true;
      if (++breakdowns % 16 == 0) reset_cpu_peak();
    }
  });
  std::mutex handed_mutex;
  std::vector<at::Tensor> handed;  // allocated by one thread, freed by another
  constexpr int kThreads = 4, kIterations = 3000;
  std::vector<std::thread> workers;
  for (int t = 0; t < kThreads; ++t)
    workers.emplace_back([&, t] {
      std::vector<at::Tensor> ring(8);
      for (int i = 0; i < kIterations; ++i) {
        PhaseScope outer(static_cast<Phase>((t + i) % kPhases));
        std::optional<PhaseScope> inner;
        if (i % 3 == 0) inner.emplace(Phase::Communication);
        at::Tensor x = at::empty({(i * 7919 + t * 104729) % 4096 + 1}, at::kFloat);
        if (i % 4 == 0) {
          std::lock_guard<std::mutex> lock(handed_mutex);
          handed.push_back(std::move(x));
        } else if (i % 5 == 0) {
          std::lock_guard<std::mutex> lock(handed_mutex);
          if (!handed.empty()) handed.pop_back();  // frees a tensor another thread may have allocated
        }
        ring[i % ring.size()] = std::move(x);
      }
    });
  for (auto& w : workers) w.join();
  handed.clear();
  stop = true;
  reader.join();
  EXPECT_FALSE(negative.load());
  EXPECT_GT(breakdowns.load(), 0);
  EXPECT_EQ(cpu_allocated_bytes(), before);
  EXPECT_EQ(cpu_allocated_bytes_by_phase(), before_by_phase);
  reset_cpu_peak();  // one thread again: exact
  EXPECT_EQ(sum(cpu_peak_breakdown().alive_by_phase), cpu_peak_breakdown().peak_bytes);
}

TEST(MemoryBreakdown, FormatsATableLargestFirstAndJson) {
  constexpr int64_t kMiB = 1 << 20;
  PeakBreakdown b;
  b.peak_bytes = 100 * kMiB;
  b.alive_by_phase[idx(Phase::Setup)] = 25 * kMiB;
  b.alive_by_phase[idx(Phase::Forward)] = 60 * kMiB + kMiB / 2;
  b.alive_by_phase[idx(Phase::Optimizer)] = 14 * kMiB + kMiB / 2;
  b.phase_at_peak = Phase::Forward;
  EXPECT_EQ(format_breakdown(b),
            "CPU tensor memory at the peak: 100.0 MiB, reached during forward\n"
            "  forward             60.5 MiB   60.5%\n"
            "  setup               25.0 MiB   25.0%\n"
            "  optimizer           14.5 MiB   14.5%\n");
  const nlohmann::json j = breakdown_json(b);
  EXPECT_EQ(j.at("peak_bytes").get<int64_t>(), 100 * kMiB);
  EXPECT_EQ(j.at("phase_at_peak").get<std::string>(), "forward");
  EXPECT_EQ(j.at("alive_by_phase").size(), kPhases);
  EXPECT_EQ(j.at("alive_by_phase").at("forward").get<int64_t>(), 60 * kMiB + kMiB / 2);
  EXPECT_EQ(j.at("alive_by_phase").at("communication").get<int64_t>(), 0);
  for (size_t i = 0; i < kPhases; ++i) EXPECT_STRNE(phase_name(static_cast<Phase>(i)), "unknown");
}

}  // namespace
}  // namespace titan::mem
