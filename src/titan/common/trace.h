// Named ranges in profiler traces, and the memory phase they stand for.
//
//   TraceRange range("forward", mem::Phase::Forward);
//
// While a profiler is recording (components/metrics/profiler.h), the range is a user annotation in
// the Chrome trace (a slice named "forward" on this thread, as torch.profiler.record_function makes);
// otherwise it costs a check of a thread-local flag. With a phase, the CPU bytes allocated inside are
// attributed to it (memory_tracker.h). The name's parts are concatenated only while recording.
#pragma once

#include "titan/common/error.h"
#include "titan/common/memory_tracker.h"

#include <ATen/record_function.h>

#include <optional>

namespace titan {

class TraceRange {
 public:
  template <class... Parts>
  explicit TraceRange(const Parts&... name_parts) : record_(at::RecordScope::USER_SCOPE) {
    if (record_.isActive()) record_.before(detail::concat(name_parts...));
  }
  template <class... Parts>
  explicit TraceRange(mem::Phase phase, const Parts&... name_parts) : TraceRange(name_parts...) {
    phase_.emplace(phase);
  }
  TraceRange(const TraceRange&) = delete;
  TraceRange& operator=(const TraceRange&) = delete;

 private:
  at::RecordFunction record_;
  std::optional<mem::PhaseScope> phase_;
};

}  // namespace titan
