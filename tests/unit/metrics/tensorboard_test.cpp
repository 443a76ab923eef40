// TensorBoard event files written by titan, read back by TensorBoard's own readers
// (tests/reference/tensorboard_read.py: its CRC-checking record reader and EventAccumulator).
// Values are stored as float32 (Summary.Value.simple_value), so they must come back exactly as
// the float32 rounding of what was written.
#include "test_util.h"

#include "titan/components/metrics/metrics.h"
#include "titan/components/metrics/tensorboard.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

namespace titan::metrics {
namespace {

nlohmann::json read_with_tensorboard(const std::string& log_dir) {
  auto result = test::run_process({test::python(), std::string(TITAN_SOURCE_DIR) + "/tests/reference/tensorboard_read.py", log_dir});
  EXPECT_EQ(result.exit_code, 0) << result.output;
  // The reader's JSON is the last line; TensorBoard may print notices before it.
  const size_t start = result.output.rfind("\n{");
  return nlohmann::json::parse(start == std::string::npos ? result.output : result.output.substr(start + 1));
}

// (step, scalars) written by the tests below.
std::vector<std::pair<int64_t, Scalars>> sample_events() {
  std::vector<std::pair<int64_t, Scalars>> events;
  for (int64_t step : {1, 10, 20, 1000000}) {
    const double s = static_cast<double>(step);
    events.push_back({step,
                      {{"loss_metrics/global_avg_loss", 10.0 / (1 + s) + 0.1},
                       {"grad_norm", 1.0 / 3.0 * s},
                       {"throughput(tps)", 1710.4 * s},
                       {"lr", -8e-4 / s},
                       {"memory/max_reserved(GiB)", 36.2}}});
  }
  return events;
}

void expect_scalars(const nlohmann::json& read, const std::vector<std::pair<int64_t, Scalars>>& events) {
  std::map<std::string, std::vector<std::pair<int64_t, float>>> expected;
  for (const auto& [step, scalars] : events) {
    for (const auto& [tag, value] : scalars) expected[tag].push_back({step, static_cast<float>(value)});
  }
  ASSERT_EQ(read["scalars"].size(), expected.size()) << read.dump();
  for (const auto& [tag, points] : expected) {
    ASSERT_TRUE(read["scalars"].contains(tag)) << tag;
    const auto& got = read["scalars"][tag];
    ASSERT_EQ(got.size(), points.size()) << tag;
    for (size_t i = 0; i < points.size(); ++i) {
      EXPECT_EQ(got[i][0].get<int64_t>(), points[i].first) << tag;
      EXPECT_EQ(static_cast<float>(got[i][1].get<double>()), points[i].second) << tag << " at step " << points[i].first;
    }
  }
}

TEST(MetricsTensorBoard, ReadBackByTensorBoard) {
  test::TempDir dir;
  const auto events = sample_events();
  std::string path;
  {
    TensorBoardWriter writer(dir / "run");
    path = writer.path();
    for (const auto& [step, scalars] : events) writer.add_scalars(step, scalars);
  }
  EXPECT_TRUE(std::regex_match(std::filesystem::path(path).filename().string(),
                               std::regex(R"(events\.out\.tfevents\.\d{10}\..+\.\d+\.\d+)")))
      << path;
  const nlohmann::json read = read_with_tensorboard(dir / "run");
  EXPECT_EQ(read["files"].size(), 1u);
  EXPECT_TRUE(read["crc_error"].is_null()) << read["crc_error"];
  EXPECT_EQ(read["records"].get<size_t>(), 1 + events.size());
  EXPECT_EQ(read["first_file_version"], "brain.Event:2");
  expect_scalars(read, events);
}

TEST(MetricsTensorBoard, VisibleBeforeClose) {
  // Each add_scalars is flushed: a reader sees it while the writer is still open.
  test::TempDir dir;
  TensorBoardWriter writer(dir / "run");
  const auto events = sample_events();
  writer.add_scalars(events[0].first, events[0].second);
  expect_scalars(read_with_tensorboard(dir / "run"), {events[0]});
}

TEST(MetricsTensorBoard, CorruptionIsDetected) {
  // Flipping one byte inside the last record's data must fail TensorBoard's CRC check, which shows
  // that the reader does verify our checksums.
  test::TempDir dir;
  const auto events = sample_events();
  std::string path;
  {
    TensorBoardWriter writer(dir / "run");
    path = writer.path();
    for (const auto& [step, scalars] : events) writer.add_scalars(step, scalars);
  }
  const auto size = std::filesystem::file_size(path);
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekg(static_cast<std::streamoff>(size) - 10);
  char byte = 0;
  file.read(&byte, 1);
  byte ^= 0x01;
  file.seekp(static_cast<std::streamoff>(size) - 10);
  file.write(&byte, 1);
  file.close();
  const nlohmann::json read = read_with_tensorboard(dir / "run");
  EXPECT_FALSE(read["crc_error"].is_null());
  EXPECT_EQ(read["records"].get<size_t>(), events.size());  // the version record + all but the last
}

TEST(MetricsTensorBoard, RunFolderLayout) {
  const std::string dir = tensorboard_run_dir("/out", "tb", false, 3);
  EXPECT_TRUE(std::regex_match(dir, std::regex(R"(/out/tb/\d{8}-\d{4})"))) << dir;
  const std::string per_rank = tensorboard_run_dir("/out", "tb", true, 3);
  EXPECT_TRUE(std::regex_match(per_rank, std::regex(R"(/out/tb/\d{8}-\d{4}/rank_3)"))) << per_rank;
}

TEST(MetricsTensorBoard, LoggerWritesItsScalars) {
  test::TempDir dir;
  std::ostringstream out;
  MetricsOptions options;
  options.enable_tensorboard = true;
  options.dump_folder = dir.path();
  options.out = &out;
  options.progress = false;
  std::vector<std::pair<int64_t, Scalars>> written;
  std::string event_file;
  {
    MetricsLogger logger(options);
    event_file = logger.tensorboard_path();
    for (int64_t step : {1, 10}) {
      StepStats s;
      s.step = step;
      s.loss = 8.0 - step * 0.1;
      s.max_loss = 8.5 - step * 0.1;
      s.grad_norm = 1.5;
      s.lr = 8e-4;
      s.tokens_since_last_log = 16384 * (step == 1 ? 1 : 9);
      s.seconds_since_last_log = 2.0;
      s.steps_since_last_log = step == 1 ? 1 : 9;
      s.flops_per_token = 1.2e8;
      s.ntokens_seen = 16384 * step;
      s.data_loading_seconds = 0.01;
      written.push_back({step, logger.log(s, {{"custom/extra", 42.5}}).scalars});
    }
  }
  const std::filesystem::path file(event_file);
  EXPECT_EQ(file.parent_path().parent_path(), std::filesystem::path(dir / "tb"));
  const nlohmann::json read = read_with_tensorboard(file.parent_path().string());
  expect_scalars(read, written);
  for (const char* tag : {"loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "grad_norm", "lr",
                          "throughput(tps)", "tflops", "n_tokens_seen", "memory/max_active(GiB)", "memory/max_reserved(%)",
                          "time_metrics/end_to_end(s)", "time_metrics/data_loading(%)", "custom/extra"}) {
    EXPECT_TRUE(read["scalars"].contains(tag)) << tag;
  }
  EXPECT_FALSE(read["scalars"].contains("mfu(%)"));  // no peak FLOP/s on CPU
}

}  // namespace
}  // namespace titan::metrics
