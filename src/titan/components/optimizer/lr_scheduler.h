// Learning-rate schedule: linear warmup, an optional stable phase, then decay (linear | sqrt |
// cosine) down to min_lr_factor x lr — torchtitan's warmup-stable-decay schedule, step for step.
//
// factor(s) for the 0-based scheduler step s (training step s + 1 uses lr * factor(s)):
//   s < warmup:                 (s + 1) / warmup
//   s < warmup + stable:        1
//   otherwise:                  p = (s + 1 - warmup - stable) / decay,
//                               min + (1 - min) * {1 - p | 1 - sqrt(p) | (1 + cos(pi p)) / 2}
// (p clamped to 1: past the last step the factor stays at min), with warmup clamped to the total steps, decay = round(total * decay_ratio) (clamped so that
// warmup + decay <= total) or total - warmup without decay_ratio, stable = total + 1 - warmup - decay.
#pragma once

#include "titan/config/sections_train.h"

#include <cstdint>
#include <optional>
#include <string>

namespace titan {

struct LRScheduleOptions {
  int64_t warmup_steps = 200;
  std::optional<double> decay_ratio;  // none: decay over all steps after warmup
  std::string decay_type = "linear";  // "linear" | "sqrt" | "cosine"
  double min_lr_factor = 0.0;
};

// The [lr_scheduler] section's options.
LRScheduleOptions lr_schedule_options(const config::LRScheduler& section);

class LRSchedule {
 public:
  // total_steps: training.steps (or lr_scheduler.total_steps when set). UserError on bad options.
  LRSchedule(const LRScheduleOptions& opts, int64_t total_steps);
  // Multiplier of the base lr for 0-based scheduler step `step`.
  double factor(int64_t step) const;
  int64_t warmup_steps() const { return warmup_; }
  int64_t stable_steps() const { return stable_; }
  int64_t decay_steps() const { return decay_; }

 private:
  LRScheduleOptions opts_;
  int64_t warmup_, stable_, decay_;
};

}  // namespace titan
