#include "titan/components/metrics/format.h"

#include <cmath>
#include <cstdio>
#include <string_view>

namespace titan::metrics {
namespace {

// Inserts a comma every three digits of the leading run of digits of `digits` (which may start
// with '-'), e.g. "-1234567.89" -> "-1,234,567.89".
std::string group_thousands(std::string_view digits) {
  size_t start = (!digits.empty() && digits[0] == '-') ? 1 : 0;
  size_t end = start;
  while (end < digits.size() && digits[end] >= '0' && digits[end] <= '9') ++end;
  std::string out(digits.substr(0, start));
  for (size_t i = start; i < end; ++i) {
    if (i > start && (end - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  out += digits.substr(end);
  return out;
}

std::string pad_left(std::string s, int width) {
  if (width > 0 && s.size() < static_cast<size_t>(width)) s.insert(0, width - s.size(), ' ');
  return s;
}

}  // namespace

std::string format_thousands(int64_t value) { return group_thousands(std::to_string(value)); }

std::string format_fixed(double value, int decimals, int width, bool thousands) {
  std::string s;
  if (std::isnan(value)) {
    s = "nan";  // Python drops the sign of a NaN; glibc would print "-nan"
  } else if (std::isinf(value)) {
    s = value < 0 ? "-inf" : "inf";
  } else {
    // glibc rounds the exact binary value to nearest, ties to even, as Python does.
    char buf[512];
    std::snprintf(buf, sizeof(buf), "%.*f", decimals, value);
    s = thousands ? group_thousands(buf) : std::string(buf);
  }
  return pad_left(std::move(s), width);
}

int64_t round_half_even(double value) {
  return static_cast<int64_t>(std::nearbyint(value));  // default rounding mode: nearest, ties to even
}

std::string format_log_line(const LogLineFields& f, bool color) {
  auto c = [color](const char* code) { return color ? std::string(code) : std::string(); };
  std::string line;
  line += c(ansi::kRed) + "step: " + pad_left(std::to_string(f.step), 2) + "  ";
  line += c(ansi::kGreen) + "loss: " + format_fixed(f.loss, 5, 8) + "  ";
  line += c(ansi::kOrange) + "grad_norm: " + format_fixed(f.grad_norm, 4, 7) + "  ";
  line += c(ansi::kTurquoise) + "memory: " + format_fixed(f.memory_gib, 2, 5) + "GiB(" +
          format_fixed(f.memory_pct, 2) + "%)  ";
  std::string tps = std::isfinite(f.tps) ? format_thousands(round_half_even(f.tps)) : format_fixed(f.tps, 0);
  line += c(ansi::kBlue) + "tps: " + tps + "  ";
  line += c(ansi::kCyan) + "tflops: " + format_fixed(f.tflops, 2, 0, /*thousands=*/true) + "  ";
  line += c(ansi::kMagenta) + "mfu: " + (f.mfu_pct ? format_fixed(*f.mfu_pct, 2) + "%" : std::string("N/A"));
  if (f.moe_imbalance && f.moe_imbalance_max)
    line += "  " + c(ansi::kOrange) + "moe_imbalance: " + format_fixed(*f.moe_imbalance, 2) + " (max " +
            format_fixed(*f.moe_imbalance_max, 2) + ")";
  if (f.moe_aux_loss) line += "  " + c(ansi::kOrange) + "moe_aux_loss: " + format_fixed(*f.moe_aux_loss, 4);
  line += c(ansi::kReset);
  return line;
}


}  // namespace titan::metrics
