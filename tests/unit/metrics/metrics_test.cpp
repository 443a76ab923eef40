// MetricsLogger on CPU: the figures it derives, the printed line, and who prints it.
#include "titan/common/error.h"
#include "titan/components/metrics/format.h"
#include "titan/components/metrics/metrics.h"

#include "test_util.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <map>

#include <regex>
#include <sstream>

namespace titan::metrics {
namespace {

StepStats sample_stats() {
  StepStats s;
  s.step = 10;
  s.loss = 7.123456;
  s.max_loss = 7.5;
  s.grad_norm = 1.0213;
  s.lr = 8e-4;
  s.tokens_since_last_log = 8 * 2048 * 10;
  s.seconds_since_last_log = 4.0;
  s.steps_since_last_log = 10;
  s.flops_per_token = 6.0e9;
  return s;
}

MetricsOptions quiet_options(std::ostream& out) {
  MetricsOptions o;
  o.out = &out;
  o.progress = false;
  return o;
}

TEST(MetricsLogger, FiguresAndLine) {
  std::ostringstream out;
  MetricsOptions options = quiet_options(out);
  options.non_data_parallel_size = 2;  // e.g. TP 2: the two ranks share the replica's tokens
  MetricsLogger logger(options);
  EXPECT_FALSE(logger.peak_flops().has_value());  // CPU

  const StepStats s = sample_stats();
  { at::Tensor interval_peak = at::ones({16 << 20}); }  // 64 MiB, freed before the log
  const LoggedMetrics& m = logger.log(s);
  const double tps = 8 * 2048 * 10 / (4.0 * 2);
  EXPECT_DOUBLE_EQ(m.tps, tps);
  EXPECT_DOUBLE_EQ(m.tflops, 6.0e9 * tps / 1e12);
  EXPECT_FALSE(m.mfu_pct.has_value());
  // CPU memory: the peak bytes of CPU tensors in the interval, a share of the machine's memory.
  EXPECT_GE(m.memory.max_reserved_gib, 64.0 / 1024);
  EXPECT_LT(m.memory.max_reserved_gib, 64.0 / 1024 + 0.05);
  EXPECT_GT(m.memory.max_reserved_pct, 0.0);
  EXPECT_LE(m.memory.max_reserved_pct, 100.0);
  EXPECT_FALSE(m.memory.num_ooms.has_value());

  LogLineFields f;
  f.step = 10;
  f.loss = s.loss;
  f.grad_norm = s.grad_norm;
  f.memory_gib = m.memory.max_reserved_gib;
  f.memory_pct = m.memory.max_reserved_pct;
  f.tps = tps;
  f.tflops = m.tflops;
  EXPECT_EQ(m.line, format_log_line(f, false));
  EXPECT_NE(m.line.find("tps: 20,480  tflops: 122.88  mfu: N/A"), std::string::npos) << m.line;

  // Printed once, with torchtitan's logging prefix, and flushed.
  const std::string printed = out.str();
  EXPECT_TRUE(std::regex_match(printed, std::regex(R"(\[titan\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - root - INFO - )" +
                                                   std::regex_replace(m.line, std::regex(R"([()|.+*?\[\]^$\\])"), R"(\$&)") +
                                                   "\n")))
      << printed;
  const auto& tb = m.scalars;
  auto value = [&tb](const std::string& tag) {
    for (const auto& [t, v] : tb) if (t == tag) return v;
    ADD_FAILURE() << "missing scalar " << tag;
    return 0.0;
  };
  EXPECT_DOUBLE_EQ(value("time_metrics/end_to_end(s)"), 0.4);
  EXPECT_DOUBLE_EQ(value("loss_metrics/global_max_loss"), 7.5);
  EXPECT_DOUBLE_EQ(value("lr"), 8e-4);
}

TEST(MetricsLogger, MixtureOfExpertsFiguresReachTheLineTensorBoardAndTheMetricsFile) {
  test::TempDir dir;
  std::ostringstream out;
  MetricsOptions options = quiet_options(out);
  options.dump_folder = dir.path();
  MetricsLogger logger(options);
  StepStats s = sample_stats();
  s.moe_imbalance = 1.25;
  s.moe_imbalance_max = 1.5;
  s.moe_aux_loss = 2.125;
  const LoggedMetrics& m = logger.log(s);
  EXPECT_NE(m.line.find("  moe_imbalance: 1.25 (max 1.50)  moe_aux_loss: 2.1250"), std::string::npos) << m.line;
  std::map<std::string, double> tb(m.scalars.begin(), m.scalars.end());
  EXPECT_EQ(tb.at("moe/load_imbalance_mean"), 1.25);
  EXPECT_EQ(tb.at("moe/load_imbalance_max"), 1.5);
  EXPECT_EQ(tb.at("moe/aux_loss"), 2.125);
  std::ifstream in(dir / "metrics.jsonl");
  std::string line, last;
  while (std::getline(in, line)) last = line;
  const nlohmann::json j = nlohmann::json::parse(last);
  EXPECT_EQ(j.at("moe_imbalance"), 1.25);
  EXPECT_EQ(j.at("moe_imbalance_max"), 1.5);
  EXPECT_EQ(j.at("moe_aux_loss"), 2.125);
}

TEST(MetricsLogger, ColorAndPrefixOptions) {
  std::ostringstream out;
  MetricsOptions options = quiet_options(out);
  options.color = true;
  options.log_prefix = false;
  MetricsLogger logger(options);
  const std::string line = logger.log(sample_stats()).line;
  EXPECT_EQ(out.str(), line + "\n");
  EXPECT_EQ(line.rfind("\033[31mstep: 10  \033[32mloss:  7.12346  ", 0), 0u) << line;
  EXPECT_EQ(line.substr(line.size() - 5), "\033[39m");
}

TEST(MetricsLogger, OnlyTheMetricsRankPrints) {
  std::ostringstream out;
  MetricsOptions options = quiet_options(out);
  options.rank = 1;
  options.metrics_rank = 0;
  options.enable_tensorboard = true;  // not written on this rank either
  options.dump_folder = "/nonexistent/never/created";
  MetricsLogger logger(options);
  EXPECT_EQ(logger.tensorboard_path(), "");
  EXPECT_FALSE(logger.log(sample_stats()).line.empty());
  EXPECT_EQ(out.str(), "");
}

TEST(MetricsLogger, ShouldLog) {
  std::ostringstream out;
  MetricsOptions options = quiet_options(out);
  options.log_freq = 5;
  MetricsLogger logger(options);
  std::vector<int64_t> logged;
  for (int64_t step = 1; step <= 12; ++step) if (logger.should_log(step)) logged.push_back(step);
  EXPECT_EQ(logged, (std::vector<int64_t>{1, 5, 10}));
}

TEST(MetricsLogger, RejectsBadOptions) {
  std::ostringstream out;
  MetricsOptions options = quiet_options(out);
  options.log_freq = 0;
  EXPECT_THROW(MetricsLogger{options}, UserError);
  options = quiet_options(out);
  options.device = c10::Device(c10::kMeta);
  EXPECT_THROW(MetricsLogger{options}, UserError);
  options = quiet_options(out);
  options.enable_tensorboard = true;
  options.save_tb_folder = "";
  EXPECT_THROW(MetricsLogger{options}, UserError);
}

}  // namespace
}  // namespace titan::metrics
