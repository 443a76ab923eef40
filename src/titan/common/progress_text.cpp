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

namespace {

// N for a name that starts with "layers.N.", else -1.
int64_t layer_of(const std::string& name) {
  static const std::string prefix = "layers.";
  if (name.compare(0, prefix.size(), prefix) != 0) return -1;
  const size_t end = name.find('.', prefix.size());
  if (end == std::string::npos || end == prefix.size()) return -1;
  int64_t n = 0;
  for (size_t i = prefix.size(); i < end; ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}

}  // namespace

int64_t count_layers(const std::vector<std::string>& names) {
  int64_t layers = 0;
  for (const auto& name : names) layers = std::max(layers, layer_of(name) + 1);
  return layers;
}

PhaseProgress::PhaseProgress(std::string phase, int64_t layers, double interval_seconds,
                             std::function<void(const std::string&)> say, std::function<Clock::time_point()> now)
    : phase_(std::move(phase)), layers_(layers), interval_(interval_seconds), say_(std::move(say)), now_(std::move(now)) {
  start_ = last_ = now_();
}

void PhaseProgress::reached(const std::string& item) {
  const Clock::time_point t = now_();
  if (t - last_ < interval_) return;
  last_ = t;
  const int64_t layer = layer_of(item);
  char seconds[32];
  std::snprintf(seconds, sizeof seconds, "%.1f", std::chrono::duration<double>(t - start_).count());
  std::string text = phase_ + " ";
  text += layer >= 0 && layers_ > 0 ? "layer " + std::to_string(layer + 1) + " of " + std::to_string(layers_) : item;
  say_(text + " (" + seconds + " s so far)");
  ++lines_;
}

}  // namespace titan
