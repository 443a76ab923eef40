// The progress line's text, shared by the trainer (which draws it on its terminal, or reports it) and
// `titan launch` (which draws rank 0's reports on its own terminal):
//   [step 120/1000 | 12%] eta 0:03:15
#pragma once

#include <cstdint>
#include <string>

namespace titan {

// "H:MM:SS" (hours unbounded); 0:00:00 for a negative or non-finite duration.
std::string format_duration(double seconds);

// The text for `step` of `total_steps` with `eta_seconds` left (negative: unknown, "-:--:--").
std::string progress_text(int64_t step, int64_t total_steps, double eta_seconds);

// Under `titan launch` on a terminal, the launcher sets kProgressReportVariable=1 for its workers;
// the metrics rank, whose stderr is then a pipe, writes one line per redraw instead of drawing:
//   titan-progress: STEP TOTAL ETA_SECONDS
constexpr const char* kProgressReportVariable = "TITAN_LAUNCH_PROGRESS";
constexpr const char* kProgressReportPrefix = "titan-progress: ";

}  // namespace titan
