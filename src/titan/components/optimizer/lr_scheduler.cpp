#include "titan/components/optimizer/lr_scheduler.h"

#include "titan/common/error.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace titan {

LRScheduleOptions lr_schedule_options(const config::LRScheduler& s) {
  return LRScheduleOptions{s.warmup_steps, s.decay_ratio, s.decay_type, s.min_lr_factor};
}

LRSchedule::LRSchedule(const LRScheduleOptions& opts, int64_t total_steps) : opts_(opts) {
  TITAN_USER_CHECK(total_steps > 0, "training.steps must be positive, got ", total_steps);
  TITAN_USER_CHECK(opts.warmup_steps >= 0, "lr_scheduler.warmup_steps must be >= 0, got ", opts.warmup_steps);
  TITAN_USER_CHECK(opts.decay_type == "linear" || opts.decay_type == "sqrt" || opts.decay_type == "cosine",
                   "lr_scheduler.decay_type '", opts.decay_type, "' is not one of linear, sqrt, cosine");
  TITAN_USER_CHECK(opts.min_lr_factor >= 0 && opts.min_lr_factor <= 1,
                   "lr_scheduler.min_lr_factor must be in [0, 1], got ", opts.min_lr_factor);
  TITAN_USER_CHECK(!opts.decay_ratio || (*opts.decay_ratio >= 0 && *opts.decay_ratio <= 1),
                   "lr_scheduler.decay_ratio must be in [0, 1]");
  warmup_ = std::min(opts.warmup_steps, total_steps);
  if (opts.decay_ratio) {
    // Python's round(): halves to even.
    decay_ = static_cast<int64_t>(std::nearbyint(static_cast<double>(total_steps) * *opts.decay_ratio));
    decay_ = std::min(decay_, total_steps - warmup_);
  } else {
    decay_ = total_steps - warmup_;
  }
  stable_ = total_steps + 1 - warmup_ - decay_;
}

double LRSchedule::factor(int64_t step) const {
  if (step < warmup_) return static_cast<double>(step + 1) / static_cast<double>(warmup_);
  if (step < warmup_ + stable_) return 1.0;
  // Past the schedule's end (a resumed schedule that was not restarted) the rate stays at its end value.
  const double progress =
      std::min(1.0, static_cast<double>(step + 1 - warmup_ - stable_) / static_cast<double>(decay_));
  double f;
  if (opts_.decay_type == "linear")
    f = 1 - progress;
  else if (opts_.decay_type == "sqrt")
    f = 1 - std::sqrt(progress);
  else
    f = 0.5 * (1.0 + std::cos(M_PI * progress));
  return opts_.min_lr_factor + (1 - opts_.min_lr_factor) * f;
}

}  // namespace titan
