// Text formatting of the training log line, matching torchtitan's (Python format specs).
//
// The line, with the field formats of torchtitan v0.2.2 (Python format-spec notation):
//   step: {step:2}  loss: {loss:8.5f}  grad_norm: {grad_norm:7.4f}  memory: {gib:5.2f}GiB({pct:.2f}%)
//   tps: {round(tps):,}  tflops: {tflops:,.2f}  mfu: {mfu:.2f}%     (all on one line, fields separated
//   by two spaces; mfu is "N/A" when no peak FLOP/s is known for the device)
// With colors, each field is preceded by its ANSI color and the line ends with the
// default-foreground code, as torchtitan prints it.
#pragma once

#include "titan/common/progress_text.h"

#include <cstdint>
#include <optional>
#include <string>

namespace titan::metrics {

// `value` with a comma between each group of three digits: 1710 -> "1,710", -1234567 -> "-1,234,567".
std::string format_thousands(int64_t value);

// Python's format(value, "{width}{,}.{decimals}f"): fixed-point, right-aligned to `width` characters,
// with thousands separators when `thousands`. NaN prints as "nan" and infinities as "inf"/"-inf".
std::string format_fixed(double value, int decimals, int width = 0, bool thousands = false);

// Python's round(value) for a finite double: to the nearest integer, ties to even.
int64_t round_half_even(double value);

// ANSI escape codes of the fields of the log line (24-bit colors for orange and turquoise).
namespace ansi {
inline constexpr const char* kRed = "\033[31m";
inline constexpr const char* kGreen = "\033[32m";
inline constexpr const char* kYellow = "\033[33m";
inline constexpr const char* kBlue = "\033[34m";
inline constexpr const char* kMagenta = "\033[35m";
inline constexpr const char* kCyan = "\033[36m";
inline constexpr const char* kOrange = "\033[38;2;180;60;0m";
inline constexpr const char* kTurquoise = "\033[38;2;54;234;195m";
inline constexpr const char* kReset = "\033[39m";  // default foreground color
}  // namespace ansi

// The values shown on one log line.
struct LogLineFields {
  int64_t step = 0;
  double loss = 0;        // global average loss
  double grad_norm = 0;
  double memory_gib = 0;  // peak reserved memory of the interval, GiB (2^30 bytes)
  double memory_pct = 0;  // the same as a percentage of the device's capacity
  double tps = 0;         // tokens per second per device
  double tflops = 0;      // achieved TFLOP/s per device
  std::optional<double> mfu_pct;  // model FLOPs utilization in %; empty prints "N/A"
  // After torchtitan's fields, for MoE models: "  moe_imbalance: 1.23 (max 1.87)", then with an
  // auxiliary load-balancing loss "  moe_aux_loss: 8.0123".
  std::optional<double> moe_imbalance, moe_imbalance_max, moe_aux_loss;
};

// The log line (no trailing newline), with ANSI colors when `color`.
std::string format_log_line(const LogLineFields& fields, bool color);

// format_duration(seconds): "H:MM:SS" (common/progress_text.h).
using ::titan::format_duration;

}  // namespace titan::metrics
