#include "titan/components/metrics/progress.h"

#include "titan/components/metrics/format.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace titan::metrics {

ProgressLine::ProgressLine(int fd, int64_t total_steps, bool enabled, std::chrono::milliseconds min_interval)
    : fd_(fd), total_steps_(total_steps), active_(enabled && total_steps > 0 && isatty(fd) == 1),
      min_interval_(min_interval) {
  const char* report = std::getenv(kReportVariable);
  if (enabled && total_steps > 0 && !active_ && report && std::string(report) == "1") {
    active_ = report_ = true;
    min_interval_ = std::max(min_interval_, std::chrono::milliseconds(1000));
  }
}

ProgressLine::~ProgressLine() { clear(); }

std::string ProgressLine::render(int64_t step, int64_t total_steps, double eta_seconds) {
  return progress_text(step, total_steps, eta_seconds);
}

void ProgressLine::update(int64_t step, Clock::time_point now) {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (first_step_ < 0) {
    first_step_ = step;
    first_time_ = now;
  }
  const bool last = step >= total_steps_;
  if (drawn_ && !last && now - last_draw_ < min_interval_) return;
  double eta = -1;
  if (step > first_step_) {
    const double per_step = std::chrono::duration<double>(now - first_time_).count() / (step - first_step_);
    eta = per_step * static_cast<double>(std::max<int64_t>(total_steps_ - step, 0));
  }
  if (report_) {
    char eta_text[32];
    std::snprintf(eta_text, sizeof eta_text, "%.1f", eta);
    write_all(std::string(kReportPrefix) + std::to_string(step) + " " + std::to_string(total_steps_) + " " + eta_text +
              "\n");
    last_draw_ = now;
    drawn_ = true;
    return;
  }
  write_all("\r\033[K" + render(step, total_steps_, eta));
  drawn_ = true;
  last_draw_ = now;
}

void ProgressLine::clear() {
  if (!active_ || report_) return;  // the launcher erases its own line
  std::lock_guard<std::mutex> lock(mutex_);
  if (!drawn_) return;
  write_all("\r\033[K");
  drawn_ = false;
}

void ProgressLine::write_all(const std::string& text) {
  // A failed write to a terminal only loses a cosmetic line: it is not an error of the run.
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

}  // namespace titan::metrics
