// The progress line: drawn only on terminals (checked with a pseudo-terminal), silent on pipes.
#include "titan/components/metrics/progress.h"
#include "titan/common/progress_text.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <pty.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace titan::metrics {
namespace {

using namespace std::chrono_literals;

// Everything readable from `fd` now (non-blocking).
std::string drain(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) text.append(buf, static_cast<size_t>(n));
  return text;
}

TEST(MetricsProgress, Render) {
  EXPECT_EQ(ProgressLine::render(120, 1000, 195), "[step 120/1000 | 12%] eta 0:03:15");
  EXPECT_EQ(ProgressLine::render(1, 10, -1), "[step 1/10 | 10%] eta -:--:--");
}

TEST(MetricsProgress, NothingWhenNotATerminal) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  {
    ProgressLine progress(fds[1], 10, true, 0ms);
    EXPECT_FALSE(progress.active());
    const auto t0 = ProgressLine::Clock::now();
    for (int step = 1; step <= 10; ++step) progress.update(step, t0 + step * 1s);
    progress.clear();
  }
  close(fds[1]);
  EXPECT_EQ(drain(fds[0]), "");
  close(fds[0]);
}

TEST(MetricsProgress, DrawsOnATerminal) {
  int master = -1, slave = -1;
  ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
  {
    ProgressLine progress(slave, 10, true, 0ms);
    ASSERT_TRUE(progress.active());
    const auto t0 = ProgressLine::Clock::now();
    progress.update(1, t0);
    progress.update(5, t0 + 8s);  // 2 s per step, 5 steps left
    std::string text = drain(master);
    EXPECT_NE(text.find("\r\033[K[step 1/10 | 10%] eta -:--:--"), std::string::npos) << text;
    EXPECT_NE(text.find("\r\033[K[step 5/10 | 50%] eta 0:00:10"), std::string::npos) << text;
    progress.clear();
    EXPECT_EQ(drain(master), "\r\033[K");
    progress.clear();  // nothing drawn: nothing to clear
    EXPECT_EQ(drain(master), "");
  }
  // Disabled or without a step count, a terminal gets nothing either.
  ProgressLine disabled(slave, 10, false), no_total(slave, 0, true);
  EXPECT_FALSE(disabled.active());
  EXPECT_FALSE(no_total.active());
  close(slave);
  close(master);
}

TEST(MetricsProgress, Throttled) {
  int master = -1, slave = -1;
  ASSERT_EQ(openpty(&master, &slave, nullptr, nullptr, nullptr), 0);
  {
    ProgressLine progress(slave, 100, true, 100ms);
    const auto t0 = ProgressLine::Clock::now();
    progress.update(1, t0);
    progress.update(2, t0 + 10ms);   // too soon: skipped
    progress.update(3, t0 + 150ms);  // drawn
    progress.update(100, t0 + 160ms);  // the last step is always drawn
    const std::string text = drain(master);
    EXPECT_EQ(text.find("[step 2/"), std::string::npos) << text;
    EXPECT_NE(text.find("[step 3/100"), std::string::npos) << text;
    EXPECT_NE(text.find("[step 100/100 | 100%] eta 0:00:00"), std::string::npos) << text;
  }
  close(slave);
  close(master);
}

// A long start-up phase says where it is every interval, by layer; a short one says nothing.
TEST(PhaseProgress, ALineEveryIntervalNamingTheLayerReached) {
  EXPECT_EQ(count_layers({"tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.15.ffn.w1.weight",
                          "layers.x.y", "norm.weight"}),
            16);
  EXPECT_EQ(count_layers({"output.weight"}), 0);
  auto t = std::chrono::steady_clock::time_point{};
  std::vector<std::string> said;
  PhaseProgress progress("Model: initializing", 16, 5.0, [&](const std::string& line) { said.push_back(line); },
                         [&] { return t; });
  progress.reached("tok_embeddings.weight");  // at 0 s: nothing yet
  t += 4s;
  progress.reached("layers.3.attention.wq.weight");
  EXPECT_TRUE(said.empty());
  t += 1500ms;
  progress.reached("layers.4.attention.wq.weight");
  t += 1s;
  progress.reached("layers.5.attention.wq.weight");  // 1 s after the last line
  t += 5s;
  progress.reached("output.weight");
  ASSERT_EQ(said.size(), 2u);
  EXPECT_EQ(said[0], "Model: initializing layer 5 of 16 (5.5 s so far)");
  EXPECT_EQ(said[1], "Model: initializing output.weight (11.5 s so far)");
  EXPECT_EQ(progress.lines(), 2);
}

}  // namespace
}  // namespace titan::metrics
