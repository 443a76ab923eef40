#include "titan/common/memory_tracker.h"

#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

namespace titan::mem {
namespace {

std::atomic<int64_t> g_current{0}, g_peak{0}, g_count{0};
std::atomic<bool> g_installed{false};
// Bytes alive per allocating phase. Every allocation adds to its phase before the total, and every
// free subtracts from it before the total, so with one thread they sum to g_current at each new peak.
std::array<std::atomic<int64_t>, kPhases> g_alive_by_phase{};

// The breakdown of the current peak. g_peak_mutex guards it and every store to g_peak (loads of
// g_peak stay lock-free: the allocation path reads it to see whether it sets a new peak).
std::mutex g_peak_mutex;
PeakBreakdown g_peak_breakdown;

// Constant-initialized, so reading it is one load from the thread's TLS block.
thread_local Phase t_phase = Phase::Other;

// Each allocation carries a header of one alignment unit before the data, so that the data pointer
// is also the deleter's context (Allocator::raw_allocate, used by oneDNN, needs that):
//   bytes 0-7: the size in bytes (int64), byte 8: the allocating phase.
constexpr size_t kHeader = 64;  // c10's CPU alignment: the data stays aligned like the default allocator's
constexpr size_t kPhaseOffset = sizeof(int64_t);
static_assert(kPhaseOffset + sizeof(Phase) <= kHeader);

std::array<int64_t, kPhases> load_by_phase() {
  std::array<int64_t, kPhases> out{};
  for (size_t i = 0; i < kPhases; ++i) out[i] = g_alive_by_phase[i].load(std::memory_order_relaxed);
  return out;
}

// Called after an allocation brought the total to `now`: a new peak captures the per-phase figures.
// Only allocations that set a new peak take the lock (every allocation while memory climbs).
void raise_peak(int64_t now, Phase phase) {
  if (now <= g_peak.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_peak_mutex);
  if (now <= g_peak.load(std::memory_order_relaxed)) return;  // another thread set a higher one
  g_peak.store(now, std::memory_order_relaxed);
  g_peak_breakdown.peak_bytes = now;
  g_peak_breakdown.alive_by_phase = load_by_phase();
  g_peak_breakdown.phase_at_peak = phase;
}

void free_counted(void* data) {
  if (!data) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t bytes = 0;
  std::memcpy(&bytes, base, sizeof bytes);
  const auto phase = static_cast<uint8_t>(base[kPhaseOffset]);
  g_alive_by_phase[phase].fetch_sub(bytes, std::memory_order_relaxed);
  g_current.fetch_sub(bytes, std::memory_order_relaxed);
  c10::free_cpu(base);
}

std::mutex g_failure_mutex;
std::optional<AllocationFailure> g_failure;

class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const int64_t bytes = static_cast<int64_t>(n);
    const Phase phase = t_phase;
    char* base = nullptr;
    try {
      base = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    } catch (const c10::Error& e) {  // out of memory (malloc failed): an error the trainer can name
      const int64_t alive = g_current.load(std::memory_order_relaxed);
      {
        std::lock_guard<std::mutex> lock(g_failure_mutex);
        g_failure = AllocationFailure{bytes, phase, alive};
      }
      throw c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                  "CPU out of memory: could not allocate " + std::to_string(bytes) + " bytes (" +
                                      e.what_without_backtrace() + ")");
    }
    std::memcpy(base, &bytes, sizeof bytes);
    base[kPhaseOffset] = static_cast<char>(phase);
    void* data = base + kHeader;
    g_count.fetch_add(1, std::memory_order_relaxed);
    g_alive_by_phase[static_cast<size_t>(phase)].fetch_add(bytes, std::memory_order_relaxed);
    raise_peak(g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes, phase);
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
    // A failed CAFFE_ENFORCE, which the CPU allocator's out-of-memory is, throws instead of
    // aborting the process, so that the run can say what ran out and what to change.
    FLAGS_caffe2_use_fatal_for_enforce = false;
    static CountingAllocator allocator;
    c10::SetAllocator(c10::DeviceType::CPU, &allocator, /*priority=*/100);
    g_installed = true;
  });
}

std::optional<AllocationFailure> last_cpu_allocation_failure() {
  std::lock_guard<std::mutex> lock(g_failure_mutex);
  return g_failure;
}

bool cpu_tracking_installed() { return g_installed.load(); }
int64_t cpu_allocated_bytes() { return g_current.load(std::memory_order_relaxed); }
int64_t cpu_peak_bytes() { return g_peak.load(std::memory_order_relaxed); }
int64_t cpu_allocation_count() { return g_count.load(std::memory_order_relaxed); }

void reset_cpu_peak() {
  std::lock_guard<std::mutex> lock(g_peak_mutex);
  g_peak_breakdown.alive_by_phase = load_by_phase();
  g_peak_breakdown.peak_bytes = g_current.load(std::memory_order_relaxed);
  g_peak_breakdown.phase_at_peak = t_phase;
  g_peak.store(g_peak_breakdown.peak_bytes, std::memory_order_relaxed);
}

PeakScope::PeakScope() {
  install_cpu_tracking();
  reset_cpu_peak();
  start_ = cpu_allocated_bytes();
}

int64_t PeakScope::peak_above_start() const { return cpu_peak_bytes() - start_; }

// ---------------------------------------------------------------------------------------------
// Phases

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::Other: return "other";
    case Phase::Setup: return "setup";
    case Phase::Data: return "data";
    case Phase::Forward: return "forward";
    case Phase::Backward: return "backward";
    case Phase::Optimizer: return "optimizer";
    case Phase::Checkpoint: return "checkpoint";
    case Phase::Validation: return "validation";
    case Phase::Communication: return "communication";
  }
  return "unknown";
}
static_assert(static_cast<size_t>(Phase::Communication) + 1 == kPhases, "kPhases counts every Phase");

Phase current_phase() { return t_phase; }

PhaseScope::PhaseScope(Phase phase) : previous_(t_phase) { t_phase = phase; }
PhaseScope::~PhaseScope() { t_phase = previous_; }

std::array<int64_t, kPhases> cpu_allocated_bytes_by_phase() { return load_by_phase(); }

PeakBreakdown cpu_peak_breakdown() {
  std::lock_guard<std::mutex> lock(g_peak_mutex);
  return g_peak_breakdown;
}

std::string format_breakdown(const PeakBreakdown& b) {
  constexpr double kMiB = 1024.0 * 1024.0;
  std::vector<size_t> order;
  for (size_t i = 0; i < kPhases; ++i)
    if (b.alive_by_phase[i] != 0) order.push_back(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return b.alive_by_phase[x] > b.alive_by_phase[y]; });
  char line[160];
  std::snprintf(line, sizeof line, "CPU tensor memory at the peak: %.1f MiB, reached during %s\n",
                b.peak_bytes / kMiB, phase_name(b.phase_at_peak));
  std::string out = line;
  for (size_t i : order) {
    const double share = b.peak_bytes > 0 ? 100.0 * b.alive_by_phase[i] / b.peak_bytes : 0.0;
    std::snprintf(line, sizeof line, "  %-13s %10.1f MiB %6.1f%%\n", phase_name(static_cast<Phase>(i)),
                  b.alive_by_phase[i] / kMiB, share);
    out += line;
  }
  return out;
}

nlohmann::json breakdown_json(const PeakBreakdown& b) {
  nlohmann::json by_phase = nlohmann::json::object();
  for (size_t i = 0; i < kPhases; ++i) by_phase[phase_name(static_cast<Phase>(i))] = b.alive_by_phase[i];
  return {{"peak_bytes", b.peak_bytes}, {"phase_at_peak", phase_name(b.phase_at_peak)}, {"alive_by_phase", by_phase}};
}

}  // namespace titan::mem
