#include "titan/components/metrics/metrics.h"

#include "titan/common/error.h"
#include "titan/components/metrics/format.h"
#include "titan/components/metrics/peak_flops.h"

#include <nlohmann/json.hpp>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <cstring>
#include <ctime>
#include <iostream>

namespace titan::metrics {

namespace {

// A float for the metrics file: JSON has no NaN or infinity, so those are the strings "nan", "inf", "-inf".
nlohmann::ordered_json number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

MetricsOptions metrics_options(const config::Metrics& m, const config::Job& job, int64_t total_steps) {
  MetricsOptions mo;
  mo.log_freq = m.log_freq;
  mo.enable_tensorboard = m.enable_tensorboard;
  mo.save_tb_folder = m.save_tb_folder;
  mo.save_for_all_ranks = m.save_for_all_ranks;
  mo.dump_folder = job.dump_folder;
  mo.color = default_color(m.disable_color_printing);
  mo.total_steps = total_steps;
  if (const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT")) mo.restart = std::atoll(attempt);
  return mo;
}

bool default_color(bool disable_color_printing) {
  if (disable_color_printing || isatty(STDOUT_FILENO) != 1) return false;
  if (std::getenv("NO_COLOR") != nullptr) return false;
  const char* term = std::getenv("TERM");
  return term == nullptr || std::strcmp(term, "dumb") != 0;
}

std::string log_prefix(const char* level) {
  using namespace std::chrono;
  const auto now = system_clock::now();
  const std::time_t seconds = system_clock::to_time_t(now);
  const auto millis = duration_cast<milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm local{};
  localtime_r(&seconds, &local);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%d %H:%M:%S", &local);
  char out[96];
  std::snprintf(out, sizeof(out), "[titan] %s,%03d - root - %s - ", stamp, static_cast<int>(millis), level);
  return out;
}

MetricsLogger::MetricsLogger(MetricsOptions options)
    : options_(std::move(options)),
      out_(options_.out != nullptr ? *options_.out : std::cout),
      memory_(options_.device),
      progress_(STDERR_FILENO, options_.total_steps, options_.progress && options_.rank == options_.metrics_rank) {
  TITAN_USER_CHECK(options_.log_freq > 0, "metrics.log_freq must be greater than 0 (got ", options_.log_freq, ").");
  TITAN_USER_CHECK(options_.non_data_parallel_size > 0, "metrics: non_data_parallel_size must be positive (got ",
                   options_.non_data_parallel_size, ").");
  TITAN_USER_CHECK(!options_.enable_tensorboard || !options_.save_tb_folder.empty(),
                   "metrics.save_tb_folder is empty: name a folder (default \"tb\") or disable TensorBoard.");
  peak_flops_ = peak_flops_for_device(memory_.device_name());
  if (memory_.is_cuda() && !peak_flops_ && is_metrics_rank()) {
    std::cerr << log_prefix("WARNING") << "peak bf16 FLOP/s unknown for " << memory_.device_name()
              << ": mfu is shown as N/A." << std::endl;
  }
  if (options_.enable_tensorboard && (options_.save_for_all_ranks || is_metrics_rank())) {
    tensorboard_ = std::make_unique<TensorBoardWriter>(tensorboard_run_dir(
        options_.dump_folder, options_.save_tb_folder, options_.save_for_all_ranks, options_.rank));
  }
  if (!options_.metrics_file.empty() && is_metrics_rank()) {
    metrics_file_path_ = (std::filesystem::path(options_.dump_folder) / options_.metrics_file).string();
    std::filesystem::create_directories(std::filesystem::path(metrics_file_path_).parent_path());
    metrics_file_ = std::make_unique<std::ofstream>(metrics_file_path_, std::ios::app);
    TITAN_USER_CHECK(metrics_file_->good(), "cannot open the metrics file ", metrics_file_path_,
                     " for appending: check that job.dump_folder is writable");
  }
}

void MetricsLogger::record_start(int64_t step) {
  append_record(nlohmann::ordered_json{{"kind", "start"}, {"time", unix_seconds()}, {"restart", options_.restart}, {"step", step}}
                    .dump());
}

void MetricsLogger::append_record(const std::string& json_line) {
  if (!metrics_file_) return;
  *metrics_file_ << json_line << '\n';
  metrics_file_->flush();  // a crash loses no logged step
  TITAN_USER_CHECK(metrics_file_->good(), "writing the metrics file ", metrics_file_path_,
                   " failed (disk full or removed?)");
}

bool MetricsLogger::should_log(int64_t step) const { return step == 1 || step % options_.log_freq == 0; }

void MetricsLogger::on_step(int64_t step) { progress_.update(step); }

const LoggedMetrics& MetricsLogger::log(const StepStats& s, const Scalars& extra) {
  TITAN_ASSERT(s.seconds_since_last_log > 0, "seconds_since_last_log = ", s.seconds_since_last_log);
  TITAN_ASSERT(s.steps_since_last_log > 0, "steps_since_last_log = ", s.steps_since_last_log);
  TITAN_ASSERT(s.flops_per_token > 0, "flops_per_token must be set, got ", s.flops_per_token);
  TITAN_ASSERT(s.tokens_since_last_log >= 0, "tokens_since_last_log = ", s.tokens_since_last_log);

  LoggedMetrics m;
  m.tps = static_cast<double>(s.tokens_since_last_log) /
          (s.seconds_since_last_log * static_cast<double>(options_.non_data_parallel_size));
  m.tflops = s.flops_per_token * m.tps / 1e12;
  if (peak_flops_) m.mfu_pct = 100.0 * s.flops_per_token * m.tps / *peak_flops_;
  m.memory = memory_.peak_stats();

  Scalars& t = m.scalars;
  t = {{"loss_metrics/global_avg_loss", s.loss},
       {"loss_metrics/global_max_loss", s.max_loss},
       {"grad_norm", s.grad_norm},
       {"throughput(tps)", m.tps},
       {"tflops", m.tflops}};
  if (m.mfu_pct) t.emplace_back("mfu(%)", *m.mfu_pct);
  t.emplace_back("time_metrics/end_to_end(s)", s.seconds_since_last_log / static_cast<double>(s.steps_since_last_log));
  if (s.data_loading_seconds) {
    t.emplace_back("time_metrics/data_loading(s)", *s.data_loading_seconds / static_cast<double>(s.steps_since_last_log));
    t.emplace_back("time_metrics/data_loading(%)", 100.0 * *s.data_loading_seconds / s.seconds_since_last_log);
  }
  t.emplace_back("memory/max_active(GiB)", m.memory.max_active_gib);
  t.emplace_back("memory/max_active(%)", m.memory.max_active_pct);
  t.emplace_back("memory/max_reserved(GiB)", m.memory.max_reserved_gib);
  t.emplace_back("memory/max_reserved(%)", m.memory.max_reserved_pct);
  if (m.memory.num_alloc_retries) t.emplace_back("memory/num_alloc_retries", static_cast<double>(*m.memory.num_alloc_retries));
  if (m.memory.num_ooms) t.emplace_back("memory/num_ooms", static_cast<double>(*m.memory.num_ooms));
  if (s.ntokens_seen) t.emplace_back("n_tokens_seen", static_cast<double>(*s.ntokens_seen));
  t.emplace_back("lr", s.lr);
  if (s.moe_imbalance) t.emplace_back("moe/load_imbalance_mean", *s.moe_imbalance);
  if (s.moe_imbalance_max) t.emplace_back("moe/load_imbalance_max", *s.moe_imbalance_max);
  if (s.moe_aux_loss) t.emplace_back("moe/aux_loss", *s.moe_aux_loss);
  for (const auto& [name, tokens] : s.data_source_tokens)
    t.emplace_back("data/tokens/" + name, static_cast<double>(tokens));
  t.insert(t.end(), extra.begin(), extra.end());
  if (tensorboard_) tensorboard_->add_scalars(s.step, t);

  LogLineFields fields;
  fields.step = s.step;
  fields.loss = s.loss;
  fields.grad_norm = s.grad_norm;
  fields.memory_gib = m.memory.max_reserved_gib;
  fields.memory_pct = m.memory.max_reserved_pct;
  fields.tps = m.tps;
  fields.tflops = m.tflops;
  fields.mfu_pct = m.mfu_pct;
  fields.moe_imbalance = s.moe_imbalance;
  fields.moe_imbalance_max = s.moe_imbalance_max;
  fields.moe_aux_loss = s.moe_aux_loss;
  m.line = format_log_line(fields, options_.color);

  if (is_metrics_rank()) {
    progress_.clear();  // the line must not land in the middle of the progress indicator
    const int64_t retries = m.memory.num_alloc_retries.value_or(0), ooms = m.memory.num_ooms.value_or(0);
    if (retries > seen_alloc_retries_) {
      std::cerr << log_prefix("WARNING") << retries << " CUDA memory allocation retries." << std::endl;
    }
    if (ooms > seen_ooms_) std::cerr << log_prefix("WARNING") << ooms << " CUDA OOM errors thrown." << std::endl;
    seen_alloc_retries_ = retries;
    seen_ooms_ = ooms;
    out_ << (options_.log_prefix ? log_prefix() : std::string()) << m.line << std::endl;  // endl: flush per line
    progress_.update(s.step);
  }
  if (metrics_file_) {
    nlohmann::ordered_json j{{"kind", "train"},       {"step", s.step},           {"time", unix_seconds()},
                     {"loss", number(s.loss)}, {"max_loss", number(s.max_loss)}, {"grad_norm", number(s.grad_norm)},
                     {"lr", number(s.lr)},     {"tps", number(m.tps)},     {"tflops", number(m.tflops)},
                     {"mfu_pct", m.mfu_pct ? number(*m.mfu_pct) : nlohmann::ordered_json()},
                     {"memory_gib", number(m.memory.max_reserved_gib)},
                     {"memory_pct", number(m.memory.max_reserved_pct)},
                     {"memory_active_gib", number(m.memory.max_active_gib)}};
    if (s.ntokens_seen) j["tokens_seen"] = *s.ntokens_seen;
    if (s.data_loading_seconds)  // per step, as TensorBoard's time_metrics/data_loading(s)
      j["data_loading_s"] = number(*s.data_loading_seconds / static_cast<double>(s.steps_since_last_log));
    if (s.moe_imbalance) j["moe_imbalance"] = number(*s.moe_imbalance);
    if (s.moe_imbalance_max) j["moe_imbalance_max"] = number(*s.moe_imbalance_max);
    if (s.moe_aux_loss) j["moe_aux_loss"] = number(*s.moe_aux_loss);
    if (!s.data_source_tokens.empty()) {
      nlohmann::ordered_json by_source = nlohmann::ordered_json::object();
      for (const auto& [name, tokens] : s.data_source_tokens) by_source[name] = tokens;
      j["data_tokens"] = by_source;
    }
    append_record(j.dump());
  }
  memory_.reset_peak_stats();
  last_ = std::move(m);
  return last_;
}

void MetricsLogger::log_validation(const ValidationStats& v) {
  TITAN_ASSERT(v.seconds > 0, "validation seconds = ", v.seconds);
  const MemoryStats mem = memory_.peak_stats();
  const double tps = static_cast<double>(v.tokens) / (v.seconds * static_cast<double>(options_.non_data_parallel_size));
  const double perplexity = std::exp(v.loss);
  if (tensorboard_) {
    tensorboard_->add_scalars(v.step, {{"validation_metrics/loss", v.loss},
                                       {"validation_metrics/perplexity", perplexity},
                                       {"validation_metrics/throughput(tps)", tps},
                                       {"validation_metrics/memory/max_active(GiB)", mem.max_active_gib},
                                       {"validation_metrics/memory/max_active(%)", mem.max_active_pct},
                                       {"validation_metrics/memory/max_reserved(GiB)", mem.max_reserved_gib},
                                       {"validation_metrics/memory/max_reserved(%)", mem.max_reserved_pct}});
  }
  if (is_metrics_rank()) {
    // torchtitan's line: validate step: {step:2}  loss: {loss:7.4f}  memory: {:5.2f}GiB({:.2f}%)  tps: {round:,}
    const bool c = options_.color;
    char step[32];
    std::snprintf(step, sizeof step, "%2lld", static_cast<long long>(v.step));
    std::string line = std::string(c ? ansi::kYellow : "") + "validate step: " + step +
                       "  " + (c ? ansi::kGreen : "") + "loss: " + format_fixed(v.loss, 4, 7) + "  " +
                       (c ? ansi::kTurquoise : "") + "memory: " + format_fixed(mem.max_reserved_gib, 2, 5) + "GiB(" +
                       format_fixed(mem.max_reserved_pct, 2) + "%)  " + (c ? ansi::kBlue : "") + "tps: " +
                       (std::isfinite(tps) ? format_thousands(round_half_even(tps)) : std::string("nan")) + "  " +
                       (c ? ansi::kMagenta : "") + "perplexity: " + format_fixed(perplexity, 2, 0, true) +
                       (c ? ansi::kReset : "");
    progress_.clear();
    out_ << (options_.log_prefix ? log_prefix() : std::string()) << line << std::endl;
    progress_.update(v.step);
  }
  append_record(nlohmann::ordered_json{{"kind", "validation"},
                               {"step", v.step},
                               {"time", unix_seconds()},
                               {"loss", number(v.loss)},
                               {"perplexity", number(perplexity)},
                               {"tps", number(tps)},
                               {"memory_gib", number(mem.max_reserved_gib)},
                               {"memory_pct", number(mem.max_reserved_pct)}}
                    .dump());
  memory_.reset_peak_stats();
}

}  // namespace titan::metrics
