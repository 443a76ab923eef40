// The progress line on a terminal (a pseudo-terminal here): drawn by `titan train` itself, and under
// `titan launch` by the launcher from rank 0's reports; in both cases erased before any other line, so
// that no line is left half-written behind it ("... eta 0:00:00[titan] ... Training completed").
#include "test_util.h"

#include <gtest/gtest.h>

#include <regex>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";

// Runs argv with its stdout and stderr on a pseudo-terminal; returns what the terminal received.
test::ProcessResult on_a_terminal(const std::vector<std::string>& argv) {
  std::vector<std::string> cmd = {test::python(), "-c",
                                  "import os, pty, sys; status = pty.spawn(sys.argv[1:]); "
                                  "sys.exit(os.waitstatus_to_exitcode(status))"};
  cmd.insert(cmd.end(), argv.begin(), argv.end());
  return test::run_process(cmd, {{"OMP_NUM_THREADS", "1"}}, std::chrono::seconds(300));
}

std::vector<std::string> train(const std::string& dump) {
  return {"train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder", dump,
          "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "40",
          "--metrics.log_freq", "10", "--profiling.enable_profiling", "false"};
}

void expect_progress_erased_before_every_line(const std::string& out) {
  const std::regex drawn(R"(\[step \d+/40 \| \d+%\] eta [0-9:-]+)");
  int n = 0;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), drawn); it != std::sregex_iterator(); ++it) {
    ++n;
    const size_t end = static_cast<size_t>(it->position() + it->length());
    EXPECT_EQ(out.compare(end, 4, "\r\033[K"), 0) << "text follows the progress line at " << end << ": "
                                                  << out.substr(it->position(), 120);
  }
  EXPECT_GT(n, 0) << out;
  EXPECT_EQ(out.find("titan-progress:"), std::string::npos) << out;
  EXPECT_NE(out.find("Training completed"), std::string::npos) << out;
}

TEST(Progress, OneProcessOnATerminal) {
  test::TempDir dir;
  std::vector<std::string> argv = {kTitan};
  for (const auto& a : train(dir.path())) argv.push_back(a);
  auto r = on_a_terminal(argv);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_progress_erased_before_every_line(r.output);
}

TEST(Progress, UnderTheLauncherRank0sProgressIsDrawnByTheLauncher) {
  test::TempDir dir;
  std::vector<std::string> argv = {kTitan, "launch", "--nproc-per-node", "2", "--master-port", "0", "--"};
  for (const auto& a : train(dir.path())) argv.push_back(a);
  auto r = on_a_terminal(argv);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  expect_progress_erased_before_every_line(r.output);
  EXPECT_NE(r.output.find("[step 40/40 | 100%]"), std::string::npos) << r.output;  // the last step is always drawn
}

}  // namespace
}  // namespace titan
