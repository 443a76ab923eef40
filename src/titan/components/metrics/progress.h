// A one-line progress indicator with ETA for interactive terminals, e.g.
//   [step 120/1000 | 12%] eta 0:03:15
// redrawn in place ("\r" + erase-line) on a terminal, and never written anywhere else: when the
// stream is not a terminal (CI, pipes, files) the indicator prints nothing at all.
#pragma once

#include "titan/common/progress_text.h"

#include <mutex>

#include <chrono>
#include <cstdint>
#include <string>

namespace titan::metrics {

class ProgressLine {
 public:
  using Clock = std::chrono::steady_clock;

  // Draws on file descriptor `fd` (2 = stderr) when `enabled`, `total_steps` > 0 and `fd` is a
  // terminal (isatty). Redraws at most every `min_interval` (the last step is always drawn).
  ProgressLine(int fd, int64_t total_steps, bool enabled = true,
               std::chrono::milliseconds min_interval = std::chrono::milliseconds(100));
  ~ProgressLine();  // clears the line
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  // Whether anything will ever be drawn (a terminal, enabled, total_steps > 0).
  bool active() const { return active_; }

  // Records that `step` (1-based) has finished at `now` and redraws the line. The ETA is the mean
  // time per step since the first recorded step times the remaining steps; no ETA is shown until two
  // steps have been recorded.
  void update(int64_t step, Clock::time_point now = Clock::now());

  // Erases the line (call before printing anything else to the same terminal); the next update()
  // draws it again.
  void clear();

  // The text update() draws for `step` with `eta_seconds` (negative: unknown), without control codes.
  static std::string render(int64_t step, int64_t total_steps, double eta_seconds);

  // Under `titan launch` on a terminal, the launcher sets this variable for global rank 0, whose
  // stderr is then a pipe: instead of drawing, update() writes one line per redraw (at most every
  // second) that the launcher draws on its own terminal, erased before any other line:
  //   titan-progress: STEP TOTAL ETA_SECONDS     (ETA -1: unknown)
  static constexpr const char* kReportVariable = kProgressReportVariable;
  static constexpr const char* kReportPrefix = kProgressReportPrefix;

 private:
  void write_all(const std::string& text);

  int fd_;
  int64_t total_steps_;
  bool active_;
  bool report_ = false;  // lines for the launcher (kReportVariable) instead of drawing
  std::chrono::milliseconds min_interval_;
  bool drawn_ = false;
  std::mutex mutex_;  // clear() may come from another thread (a background save's log line)
  int64_t first_step_ = -1;
  Clock::time_point first_time_, last_draw_;
};

}  // namespace titan::metrics
