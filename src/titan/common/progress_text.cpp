#include "titan/common/progress_text.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace titan {

std::string format_duration(double seconds) {
  const int64_t total = std::isfinite(seconds) && seconds > 0 ? static_cast<int64_t>(std::llround(seconds)) : 0;
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(total / 3600),
                static_cast<long long>(total / 60 % 60), static_cast<long long>(total % 60));
  return buf;
}

std::string progress_text(int64_t step, int64_t total_steps, double eta_seconds) {
  const int64_t percent = total_steps > 0 ? std::clamp<int64_t>(step * 100 / total_steps, 0, 100) : 0;
  std::string text = "[step " + std::to_string(step) + "/" + std::to_string(total_steps) + " | " +
                     std::to_string(percent) + "%] eta ";
  text += eta_seconds >= 0 ? format_duration(eta_seconds) : std::string("-:--:--");
  return text;
}

}  // namespace titan
