// `titan report`: one self-contained HTML page of a run's metrics (or several runs overlaid), and a
// step-by-step comparison of two runs' loss curves.
//
//   titan report DUMP_FOLDER [DUMP_FOLDER ...] [--output FILE]
//   titan report --check RUN_A RUN_B [--rtol R] [--atol A] [--metric loss|validation_loss]
//
// Both read `<dump_folder>/metrics.jsonl` (one JSON object per line, written by the trainer's
// metrics rank; kinds "start", "train", "validation") and the page also reads
// `<dump_folder>/config.toml`. docs/metrics.md ("titan report") describes the page and the check.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace titan::report {

constexpr const char* kMetricsFile = "metrics.jsonl";
constexpr const char* kConfigFile = "config.toml";

// step -> value; NaN and +-inf are kept (the file writes them as "nan", "inf", "-inf").
using Series = std::map<int64_t, double>;
// One line of kind "train" or "validation": its numeric fields (null fields are left out).
using Record = std::map<std::string, double>;

// What one run's metrics.jsonl holds. A later line of the same kind and step replaces the earlier
// one whole (a resumed run logs again the steps after its checkpoint).
struct RunMetrics {
  std::string folder;  // the dump folder as given
  std::map<std::string, std::map<int64_t, Record>> records;  // kind -> step -> record
  int64_t starts = 0;                  // "start" lines: the first start and every restart or resume
  std::vector<int64_t> resumed_at;     // per start after the first: the first step it logged
  std::optional<double> first_time, last_time;  // Unix seconds, over every line that has "time"
  bool incomplete_last_line = false;   // an unterminated, unreadable last line was left out

  // The values of `field` in the records of `kind`, e.g. series("train", "loss").
  Series series(const std::string& kind, const std::string& field) const;
};

// Reads `<dump_folder>/metrics.jsonl`. Unknown kinds and fields are ignored. Throws UserError for a
// missing folder or file and for a malformed line, naming file:line. An unterminated last line
// that does not parse (a process killed while writing it) is left out, and flagged.
RunMetrics read_metrics(const std::string& dump_folder);
// The same from text; `file` names it in errors.
RunMetrics parse_metrics(const std::string& text, const std::string& file);

// The config settings the page shows: with several runs the keys whose values differ between
// them, with one run the keys that differ from titan's defaults. job.dump_folder is left out.
struct ConfigTable {
  bool against_defaults = false;        // one run: values[k][0] is the default, [1] the run's
  std::vector<std::string> keys;        // section.key
  std::vector<std::vector<std::string>> values;  // per key, per column; TOML literals, "" if absent
  std::vector<std::string> notes;       // e.g. a run without config.toml
};
ConfigTable config_table(const std::vector<std::string>& dump_folders);

// One plot of the page, in page order: loss, validation_loss, lr, grad_norm, tps, mfu, memory.
struct PlotSpec {
  std::string id;           // the data-metric of its <svg class="plot">
  std::string title;        // heading, e.g. "Learning rate"
  std::string kind, field;  // its values: field `field` of the records of kind `kind`
  std::string unit;         // y-axis label
  std::string absent;       // why a run records no such value (shown when none does)
};
const std::vector<PlotSpec>& plots();
// True when some run has a value (finite or not) of the plot's field: drawn; otherwise the page
// shows a one-line "not recorded" note instead.
bool recorded(const std::vector<RunMetrics>& runs, const PlotSpec& plot);

// The whole page: inline CSS, the runs' data as embedded JSON, and the script that draws the plots.
std::string render_html(const std::vector<RunMetrics>& runs, const ConfigTable& config);

// --check: `a` and `b` agree at a step when |a - b| <= atol + rtol * |b| (b is the reference), or
// when both are the same non-finite value.
struct CheckOptions {
  std::string metric = "loss";  // "loss" (train) or "validation_loss"
  double rtol = 1e-5;
  double atol = 0;
  bool common_steps_only = false;  // steps logged by one run only do not count as a difference
};
struct CheckResult {
  int64_t common_steps = 0;
  int64_t differing_steps = 0;
  std::optional<int64_t> first_difference;  // step
  double first_a = 0, first_b = 0;          // the values there
  double max_rel_diff = 0;                  // largest |a - b| / |b| over common steps (inf: b == 0 != a, or non-finite)
  int64_t max_rel_step = -1;
  std::vector<int64_t> only_in_a, only_in_b;
  bool missing_counts = true;  // a step logged by one run only is a difference (not --common-steps-only)
  bool agree() const { return differing_steps == 0 && (!missing_counts || (only_in_a.empty() && only_in_b.empty())); }
};
// Throws UserError when the runs have no step of the metric in common.
CheckResult check(const RunMetrics& a, const RunMetrics& b, const CheckOptions& options);
// The check's verdict in a few lines (what the command prints).
std::string format_check(const CheckResult& r, const RunMetrics& a, const RunMetrics& b, const CheckOptions& options);

// Exit statuses of `titan report`.
constexpr int kExitOk = 0;
constexpr int kExitDiffer = 1;  // --check: the curves differ
constexpr int kExitUsage = 2;   // bad command line or unreadable input

// The command line after `titan report`; prints errors as `titan report: error: ...` and returns
// the exit status.
int run_report(const std::vector<std::string>& args);
// Usage text of `titan report`.
std::string report_usage();

}  // namespace titan::report
