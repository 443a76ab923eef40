// Soak: a long run of the debug model, with background checkpoint saves, TensorBoard and the log, must
// not grow after warm-up: resident memory, the bytes of live CPU tensors (the counting allocator) and
// open file descriptors, sampled at the same point of every checkpoint cycle (mid-way between saves).
//
// In CI: 500 steps, saving every 50. The long run (docs/reliability.md):
//   TITAN_SOAK_STEPS=10000 TITAN_SOAK_INTERVAL=500 build/titan_tests --gtest_filter=Soak.*
#include "test_util.h"

#include "titan/common/memory_tracker.h"
#include "titan/config/job_config.h"
#include "titan/trainer/trainer.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;

int64_t env_or(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::stoll(v) : fallback;
}

struct Sample {
  int64_t step = 0, rss = 0, heap = 0, fds = 0, tensors = 0;
};

Sample sample(int64_t step) {
  Sample s;
  s.step = step;
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  s.rss = resident * sysconf(_SC_PAGESIZE);
  const struct mallinfo2 mi = mallinfo2();
  s.heap = static_cast<int64_t>(mi.uordblks + mi.hblkhd);  // bytes malloc has handed out and not got back
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++s.fds;
  s.tensors = mem::cpu_allocated_bytes();
  return s;
}

TEST(Soak, NoGrowthOfMemoryOrFileDescriptorsAfterWarmUp) {
  const int64_t steps = env_or("TITAN_SOAK_STEPS", 500);
  const int64_t interval = env_or("TITAN_SOAK_INTERVAL", 50);
  ASSERT_GE(steps, 6 * interval) << "the soak needs at least 6 checkpoint cycles";
  // One compute thread: with other tests on the same cores, OpenMP's spinning threads would make the
  // run many times slower without changing what is measured.
  at::set_num_threads(1);
  test::TempDir dir;
  // The bundled corpus pre-tokenized into shards: the tokenizer's word cache, which grows with every
  // new word up to its bound (65,536 words, ~10 MB) over many thousands of steps, stays out of the figures.
  auto tok = test::run_process({std::string(TITAN_BINARY_DIR) + "/titan", "tokenize", "--output", dir / "shards",
                                "--job.config_file", kSource + "/configs/llama3_debugmodel.toml",
                                "--model.hf_assets_path", kSource + "/assets/tokenizer"},
                               {}, std::chrono::seconds(300));
  ASSERT_EQ(tok.exit_code, 0) << tok.output;
  Trainer t(parse_config({"--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder",
                          dir.path(), "--model.hf_assets_path", kSource + "/assets/tokenizer",
                          "--training.dataset_path", dir / "shards", "--training.seq_len", "32",
                          "--training.local_batch_size", "2", "--training.steps", std::to_string(steps),
                          "--lr_scheduler.warmup_steps", "10", "--metrics.log_freq", "10", "--metrics.enable_tensorboard",
                          "--checkpoint.enable", "--checkpoint.interval", std::to_string(interval),
                          "--checkpoint.async_mode", "async", "--checkpoint.keep_latest_k", "2",
                          "--checkpoint.last_save_model_only", "false"}));
  std::vector<Sample> samples;
  t.set_step_callback([&](int64_t step) {
    if (step % interval == interval / 2) samples.push_back(sample(step));
  });
  t.train();
  // Warm-up: the first quarter of the run, at least two cycles (first allocations, the first
  // background saves, the data loader's buffers, TensorBoard's file).
  const int64_t warm_up = std::max<int64_t>(2 * interval, steps / 4);
  samples.erase(std::remove_if(samples.begin(), samples.end(), [&](const Sample& s) { return s.step < warm_up; }),
                samples.end());
  ASSERT_GE(samples.size(), 4u);
  const Sample& first = samples.front();
  std::printf("soak: %lld steps, checkpoint every %lld (async), samples after warm-up:\n", static_cast<long long>(steps),
              static_cast<long long>(interval));
  std::printf("  %8s %12s %12s %6s %14s\n", "step", "rss MiB", "heap MiB", "fds", "tensor bytes");
  int64_t max_rss = 0;
  for (const Sample& s : samples) {
    std::printf("  %8lld %12.2f %12.2f %6lld %14lld\n", static_cast<long long>(s.step), s.rss / 1048576.0,
                s.heap / 1048576.0, static_cast<long long>(s.fds), static_cast<long long>(s.tensors));
    max_rss = std::max(max_rss, s.rss);
    EXPECT_EQ(s.fds, first.fds) << "open file descriptors changed at step " << s.step;
    EXPECT_EQ(s.tensors, first.tensors) << "live CPU tensor bytes changed at step " << s.step;
  }
  // Resident memory: allow the allocator's noise (a few MiB: arenas of the save threads, page reuse),
  // not growth; a leak of 1 KiB per step shows over the long run's 7,500 steps, of 32 KiB within 375.
  const double growth_mib = (samples.back().rss - first.rss) / 1048576.0;
  const double spread_mib = (max_rss - first.rss) / 1048576.0;
  const double heap_mib = (samples.back().heap - first.heap) / 1048576.0;
  std::printf("soak: resident memory %+.2f MiB from step %lld to %lld (highest sample %+.2f MiB); malloc heap in use "
              "%+.2f MiB\n", growth_mib, static_cast<long long>(first.step), static_cast<long long>(samples.back().step),
              spread_mib, heap_mib);
  EXPECT_LT(heap_mib, 4.0);
  EXPECT_LT(growth_mib, 8.0);
  EXPECT_LT(spread_mib, 16.0);
}

}  // namespace
}  // namespace titan
