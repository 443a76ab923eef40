// The progress line's text, shared by the trainer (which draws it on its terminal, or reports it) and
// `titan launch` (which draws rank 0's reports on its own terminal):
//   [step 120/1000 | 12%] eta 0:03:15
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace titan {

// "H:MM:SS" (hours unbounded); 0:00:00 for a negative or non-finite duration.
std::string format_duration(double seconds);

// The text for `step` of `total_steps` with `eta_seconds` left (negative: unknown, "-:--:--").
std::string progress_text(int64_t step, int64_t total_steps, double eta_seconds);

// Progress through a long start-up phase, such as a large model's initialization, said as lines:
// reached(item) is called at each item (a parameter's name), and once `interval_seconds` have passed
// since the start or the last line, `say` gets "PHASE ITEM (S s so far)", where a parameter of
// block N ("layers.N.") is named as "layer N+1 of LAYERS". A phase shorter than the interval says
// nothing.
class PhaseProgress {
 public:
  using Clock = std::chrono::steady_clock;
  PhaseProgress(std::string phase, int64_t layers, double interval_seconds, std::function<void(const std::string&)> say,
                std::function<Clock::time_point()> now = &Clock::now);
  void reached(const std::string& item);
  int64_t lines() const { return lines_; }

 private:
  std::string phase_;
  int64_t layers_;
  std::chrono::duration<double> interval_;
  std::function<void(const std::string&)> say_;
  std::function<Clock::time_point()> now_;
  Clock::time_point start_, last_;
  int64_t lines_ = 0;
};

// The number of blocks ("layers.N." prefixes) among parameter names: 1 + the largest N, 0 for none.
int64_t count_layers(const std::vector<std::string>& names);

// Under `titan launch` on a terminal, the launcher sets kProgressReportVariable=1 for its workers;
// the metrics rank, whose stderr is then a pipe, writes one line per redraw instead of drawing:
//   titan-progress: STEP TOTAL ETA_SECONDS
constexpr const char* kProgressReportVariable = "TITAN_LAUNCH_PROGRESS";
constexpr const char* kProgressReportPrefix = "titan-progress: ";

}  // namespace titan
