// Counting CPU allocator: the bytes of every CPU tensor allocated through ATen, current and peak.
//
// RSS says little about tensors (the C allocator keeps freed pages, page faults are lazy); this
// counts exactly what ATen asks for, like the CUDA caching allocator's "allocated bytes". The trainer
// installs it at start-up, so the log line's CPU memory figure is the peak of these bytes, and
// memory tests measure peaks with it. Tensors allocated before install_cpu_tracking() are not
// counted (their frees are not either). Pinned host memory (CUDA's host allocator) and memory that
// libraries allocate themselves (Gloo's buffers, the tokenizer) are outside it.
#pragma once

#include <cstdint>

namespace titan::mem {

// Makes ATen's CPU allocator the counting one (idempotent, thread-safe).
void install_cpu_tracking();
bool cpu_tracking_installed();
// Bytes of CPU tensor storage alive now, and the most alive at once since the last reset.
int64_t cpu_allocated_bytes();
int64_t cpu_peak_bytes();
// Starts a new peak window: peak := bytes alive now.
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

}  // namespace titan::mem
