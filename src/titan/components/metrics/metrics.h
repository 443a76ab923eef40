// Training metrics: torchtitan's log line on stdout, TensorBoard scalars, and a progress line.
//
// The trainer measures and passes the values of each logged step (StepStats); MetricsLogger derives
// throughput and utilization, reads the device's peak memory of the interval, prints
//   step: 10  loss:  7.12345  grad_norm:  1.0213  memory: 36.20GiB(81.50%)  tps: 1,710  tflops: 98.12  mfu: 23.50%
// (see format.h for the exact field formats), and writes the same figures to TensorBoard.
//
//   tps    = tokens_since_last_log / (seconds_since_last_log * non_data_parallel_size)
//            tokens per second per device: the ranks of one data-parallel replica (TP, CP, PP) share
//            its tokens, so they are divided among them
//   tflops = flops_per_token * tps / 1e12
//   mfu    = 100 * flops_per_token * tps / peak_flops   (peak: peak_flops.h; "N/A" when unknown, e.g. CPU)
//
// The metrics rank also appends every logged figure to <dump_folder>/metrics.jsonl (one JSON object
// per line, kinds "start", "train" and "validation"; docs/metrics.md), which `titan report` reads.
//
// Usage in a training loop:
//   MetricsLogger metrics(options);
//   for (step = 1..steps) { ...train...; metrics.on_step(step);
//                           if (metrics.should_log(step)) metrics.log(stats); }
#pragma once

#include "titan/components/metrics/memory_monitor.h"
#include "titan/components/metrics/progress.h"
#include "titan/components/metrics/tensorboard.h"
#include "titan/config/sections_run.h"

#include <c10/core/Device.h>

#include <cstdint>
#include <fstream>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>

namespace titan::metrics {

// Plain options; the TOML keys they usually come from are named.
struct MetricsOptions {
  int64_t log_freq = 10;                  // [metrics] log_freq: log at step 1 and every log_freq steps
  bool enable_tensorboard = false;        // [metrics] enable_tensorboard
  std::string save_tb_folder = "tb";      // [metrics] save_tb_folder, under dump_folder
  bool save_for_all_ranks = false;        // [metrics] save_for_all_ranks: every rank writes rank_<r>/
  std::string dump_folder = "./outputs";  // [job] dump_folder
  int rank = 0;                           // this process's global rank
  int metrics_rank = 0;                   // the rank that prints the line and writes TensorBoard (the
                                          // trainer's figures are global on every rank, pipeline included)
  bool color = false;                     // ANSI colors on the line; see default_color()
  bool log_prefix = true;                 // prefix lines with "[titan] <local time> - root - INFO - "
  int64_t total_steps = 0;                // [training] steps, for the progress ETA (0: no progress line)
  bool progress = true;                   // show the progress line when stderr is a terminal
  c10::Device device = c10::Device(c10::kCPU);  // the training device, for memory and peak FLOP/s
  int64_t non_data_parallel_size = 1;     // product of the non-data-parallel degrees (tp * cp * pp)
  std::ostream* out = nullptr;            // where lines go; nullptr: std::cout
  std::string metrics_file = "metrics.jsonl";  // under dump_folder, appended by the metrics rank; "" for none
  int64_t restart = 0;                    // the launcher's restart count (TORCHELASTIC_RESTART_COUNT), recorded
};

// The [metrics] section's options (log frequency, TensorBoard, colors), with the job's dump folder,
// the run's total steps and the launcher's restart count; the trainer adds rank and device.
MetricsOptions metrics_options(const config::Metrics& section, const config::Job& job, int64_t total_steps);

// The values of one logged step, measured by the trainer.
struct StepStats {
  int64_t step = 0;
  double loss = 0;       // global average loss (sum of losses / number of valid tokens over all ranks)
  double max_loss = 0;   // maximum over ranks of the local average loss
  double grad_norm = 0;  // total gradient norm (before clipping scales it)
  double lr = 0;         // learning rate used at this step
  int64_t tokens_since_last_log = 0;  // tokens this rank's data-parallel replica processed in the interval
  double seconds_since_last_log = 0;  // wall-clock length of the interval, > 0
  int64_t steps_since_last_log = 1;   // steps in the interval, > 0
  double flops_per_token = 0;         // training FLOPs per token of the model, > 0
  std::optional<int64_t> ntokens_seen;            // tokens seen by all ranks since the start (TensorBoard)
  std::optional<double> data_loading_seconds;     // time spent waiting for batches in the interval
  // Mixture-of-experts models: the step's load imbalance (an MoE layer's busiest expert's routed
  // token copies over the mean per expert; 1 is balanced), the mean over the MoE layers and the largest.
  std::optional<double> moe_imbalance, moe_imbalance_max;
  // With an auxiliary load-balancing loss: the step's, averaged over the MoE layers and micro-batches
  // (without its coefficient; K when perfectly balanced).
  std::optional<double> moe_aux_loss;
  // A data mixture: the tokens each source has served since the start (all ranks), by source name.
  std::vector<std::pair<std::string, int64_t>> data_source_tokens;
};

// The figures of one evaluation on the validation set (torchtitan's validate step).
struct ValidationStats {
  int64_t step = 0;       // the training step after which it ran
  double loss = 0;        // average loss over every validation token of every data-parallel rank
  int64_t tokens = 0;     // tokens this rank's data-parallel replica evaluated
  double seconds = 0;     // wall-clock length of the evaluation, > 0
};

// Colors unless disabled ([metrics] disable_color_printing), stdout is not a terminal, NO_COLOR is
// set, or TERM is "dumb" (torchtitan colors unless disabled; plain text keeps redirected logs clean).
bool default_color(bool disable_color_printing);

// "[titan] 2024-10-03 15:01:18,520 - root - INFO - " for the current local time: torchtitan's prefix.
std::string log_prefix(const char* level = "INFO");

// The figures of one log() call.
struct LoggedMetrics {
  std::string line;  // the log line without prefix (with color codes when options.color)
  Scalars scalars;   // the TensorBoard scalars, in writing order
  double tps = 0, tflops = 0;
  std::optional<double> mfu_pct;
  MemoryStats memory;
};

// Not thread-safe: call from the training thread.
class MetricsLogger {
 public:
  // Validates the options (user errors for log_freq <= 0 and the like), starts the memory monitor
  // and, on the rank(s) that write it, the TensorBoard event file.
  explicit MetricsLogger(MetricsOptions options);

  // torchtitan's rule: log at step 1 and at every multiple of log_freq.
  bool should_log(int64_t step) const;

  // Advances the progress line (call once per finished step).
  void on_step(int64_t step);
  // Erases the progress line before another line goes to the terminal (the next step redraws it).
  void clear_progress() { progress_.clear(); }

  // Logs one interval: computes the figures, prints the line (on the metrics rank), writes the
  // TensorBoard scalars plus `extra` ones, and resets the memory peaks. Returns the figures.
  const LoggedMetrics& log(const StepStats& stats, const Scalars& extra = {});

  // Logs one evaluation: torchtitan's "validate step" line (with the perplexity, exp(loss), appended),
  // its TensorBoard scalars (validation_metrics/...) and a metrics-file line; resets the memory peaks.
  void log_validation(const ValidationStats& stats);

  // The last log() result.
  const LoggedMetrics& last() const { return last_; }

  // Peak FLOP/s of the device, if known; the device's name.
  std::optional<double> peak_flops() const { return peak_flops_; }
  const std::string& device_name() const { return memory_.device_name(); }

  // The TensorBoard event file ("" when this rank writes none).
  std::string tensorboard_path() const { return tensorboard_ ? tensorboard_->path() : std::string(); }
  // Appends the "start" record of this process to the metrics file: `step` is the step training
  // continues after (0 for a fresh run, S when resumed from step S). Readers drop the records of
  // steps after it that an earlier run in the same folder left. Call once set-up has succeeded.
  void record_start(int64_t step);

  // The metrics file this rank appends to ("" when none).
  const std::string& metrics_file_path() const { return metrics_file_path_; }

 private:
  bool is_metrics_rank() const { return options_.rank == options_.metrics_rank; }
  void append_record(const std::string& json_line);  // one line to the metrics file, flushed

  MetricsOptions options_;
  std::ostream& out_;
  MemoryMonitor memory_;
  std::optional<double> peak_flops_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::string metrics_file_path_;
  std::unique_ptr<std::ofstream> metrics_file_;
  ProgressLine progress_;
  LoggedMetrics last_;
  int64_t seen_alloc_retries_ = 0, seen_ooms_ = 0;
};

}  // namespace titan::metrics
