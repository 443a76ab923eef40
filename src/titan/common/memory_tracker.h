// Counting CPU allocator: the bytes of every CPU tensor allocated through ATen, current and peak,
// and at the peak, which phase of training allocated the bytes then alive.
//
// RSS says little about tensors (the C allocator keeps freed pages, page faults are lazy); this
// counts exactly what ATen asks for, like the CUDA caching allocator's "allocated bytes". The trainer
// installs it at start-up, so the log line's CPU memory figure is the peak of these bytes, and
// memory tests measure peaks with it. Tensors allocated before install_cpu_tracking() are not
// counted (their frees are not either). Pinned host memory (CUDA's host allocator) and memory that
// libraries allocate themselves (Gloo's buffers, the tokenizer) are outside it.
//
// Phases. Each thread has a current phase (Phase::Other until a PhaseScope sets one). Every
// allocation records the phase current on its thread and counts its bytes under it until freed
// (whichever thread, in whichever phase, frees it). When an allocation sets a new peak, the bytes
// alive per phase at that moment are captured: cpu_peak_breakdown() then says "at the peak, 3.1 GiB
// were alive: 1.2 GiB allocated during setup (parameters), 1.6 GiB during forward (activations kept
// for backward), ...". Work done by other threads counts under those threads' own phases: the
// autograd engine's device threads, intra-op worker threads, a data prefetch thread and an
// asynchronous checkpoint writer count under Other unless they set a PhaseScope themselves.
//
// Thread-safety: everything here may be called from any thread. The counters are atomics; the
// allocation path takes no lock except when it sets a new peak (a short critical section that copies
// nine counters). Cost, against the counting allocator without phases (64-byte blocks, one thread):
// ~5 ns more per allocate+free (~80 ns in all), ~20 ns more for an allocation that sets a new peak
// (as every one does while memory climbs after a reset); at::empty itself takes ~250 ns. With one thread allocating, the parts of a breakdown sum exactly to its peak_bytes;
// while several threads allocate at once, a breakdown is captured while other threads' allocations
// and frees are half-counted (their phase counted, the total not yet, or the reverse), so the parts
// may differ from peak_bytes by the bytes those threads had in flight. Each figure is still a value
// the counter really had, and none is ever negative.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <array>
#include <optional>
#include <cstddef>
#include <cstdint>
#include <string>

namespace titan::mem {

// Makes ATen's CPU allocator the counting one (idempotent, thread-safe).
void install_cpu_tracking();
bool cpu_tracking_installed();
// Bytes of CPU tensor storage alive now, and the most alive at once since the last reset.
int64_t cpu_allocated_bytes();
int64_t cpu_peak_bytes();
// Starts a new peak window: peak := bytes alive now, and the peak's breakdown := the bytes alive now
// per phase (its phase_at_peak := the calling thread's current phase).
void reset_cpu_peak();
// Number of CPU allocations so far (to test that a code path allocates nothing).
int64_t cpu_allocation_count();

// The peak of the bytes allocated while it is alive, above what was alive when it started.
class PeakScope {
 public:
  PeakScope();
  int64_t peak_above_start() const;  // bytes
 private:
  int64_t start_;
};

// ---------------------------------------------------------------------------------------------
// Phases of training, to attribute the bytes alive at the peak.
enum class Phase : uint8_t {
  Other,          // no phase set (the default of every thread): logging, metrics, anything unscoped
  Setup,          // building the model, initializing or loading parameters, building the optimizer
  Data,           // reading, tokenizing and batching input: token and label tensors
  Forward,        // the forward pass and the loss: activations that autograd keeps for backward
  Backward,       // the backward pass: gradients and its temporaries
  Optimizer,      // gradient clipping and the optimizer step: its states (created at the first step)
  Checkpoint,     // saving and loading checkpoints: staging copies of tensors
  Validation,     // evaluation passes (no autograd)
  Communication,  // collective buffers (all-gather, reduce-scatter, all-reduce), inside any other phase
};
constexpr size_t kPhases = 9;

// Lower-case name: "other", "setup", "data", "forward", "backward", "optimizer", "checkpoint",
// "validation", "communication".
const char* phase_name(Phase phase);
// The calling thread's current phase.
Phase current_phase();

// Sets the calling thread's phase while it is alive, then restores the previous one (scopes nest).
// Create and destroy it on the same thread.
class PhaseScope {
 public:
  explicit PhaseScope(Phase phase);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  Phase previous_;
};

// The last CPU allocation through the counting allocator that failed for want of memory (it throws
// c10::OutOfMemoryError): its size, the phase that asked, and the bytes of CPU tensors alive then.
struct AllocationFailure {
  int64_t bytes = 0;
  Phase phase = Phase::Other;
  int64_t alive_bytes = 0;
};
std::optional<AllocationFailure> last_cpu_allocation_failure();

// Bytes of CPU tensor storage alive now, by the phase that allocated them (indexed by Phase).
std::array<int64_t, kPhases> cpu_allocated_bytes_by_phase();

// The bytes alive at the peak of the window since the last reset_cpu_peak(), by allocating phase.
struct PeakBreakdown {
  int64_t peak_bytes = 0;
  std::array<int64_t, kPhases> alive_by_phase{};  // indexed by Phase; sums to peak_bytes (see above)
  Phase phase_at_peak = Phase::Other;             // the phase of the allocation that set the peak
};
PeakBreakdown cpu_peak_breakdown();

// A small table, phases with bytes largest first (phases with none left out), e.g.
//   CPU tensor memory at the peak: 1234.5 MiB, reached during forward
//     forward     800.0 MiB   64.8%
//     setup       434.5 MiB   35.2%
std::string format_breakdown(const PeakBreakdown& breakdown);
// {"peak_bytes": N, "phase_at_peak": "forward", "alive_by_phase": {"other": n, "setup": n, ...}}
// (every phase, keyed by phase_name(), bytes as integers).
nlohmann::json breakdown_json(const PeakBreakdown& breakdown);

}  // namespace titan::mem
