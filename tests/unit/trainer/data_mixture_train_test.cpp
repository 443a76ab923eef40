// Training on a data mixture (training.dataset_mix): FSDP over 2 processes trains on the same global
// batches as one process (same per-step losses, 1e-5 relative), a checkpoint saved under one layout
// resumes under the other with the losses of the run that was not interrupted, and the per-source token
// counts reach metrics.jsonl. The two processes tokenize the text source together.
#include "data/data_test_util.h"
#include "test_util.h"

#include "titan/components/checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";

// An llm.c token file of ids below the debug tokenizer's 2048.
void write_tokens(const std::string& path, int n) {
  test::write_llmc_gpt2(path, n, [](int i) { return (i * 131 + i / 3) % 2048; });
}

std::vector<double> losses_of(const test::TempDir& dir, const std::string& name) {
  const auto t = safetensors::load(dir / name).tensors.at("__losses__");
  std::vector<double> out;
  for (int64_t i = 0; i < t.numel(); ++i) out.push_back(t[i].item<double>());
  return out;
}

TEST(DataMixtureTraining, Fsdp2EqualsOneProcessAndResumesAcrossLayouts) {
  test::TempDir dir;
  write_tokens(dir / "tokens.bin", 5000);
  auto args = [&](const std::string& dump, int local_batch, int steps, std::vector<std::string> extra) {
    std::vector<std::string> a = {"train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml",
                                  "--job.dump_folder", dump, "--training.seq_len", "32",
                                  "--training.local_batch_size", std::to_string(local_batch),
                                  "--training.global_batch_size", "4", "--training.steps", std::to_string(steps),
                                  "--training.dataset_mix", "0.7 titan_corpus,0.3 tok=" + (dir / "tokens.bin"),
                                  "--metrics.log_freq", "1"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  auto run = [&](std::vector<std::string> launcher, std::vector<std::string> a, const std::string& weights) {
    launcher.insert(launcher.end(), a.begin(), a.end());
    auto r = test::run_process(launcher, {{"TITAN_DEBUG_DUMP_WEIGHTS", dir / weights}, {"OMP_NUM_THREADS", "1"}},
                               std::chrono::seconds(600));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r;
  };
  const std::vector<std::string> two = {kTitan, "launch", "--nproc-per-node", "2", "--master-port", "0", "--"};
  auto one = run({kTitan}, args(dir / "one", 4, 6, {}), "one.safetensors");
  EXPECT_NE(one.output.find("Data: mixture of titan_corpus (weight 0.7, text from"), std::string::npos) << one.output;
  // The two processes of the node tokenize the text source together (text_windows.h).
  const auto two_run = run(two, args(dir / "two", 2, 6, {}), "two.safetensors");
  EXPECT_NE(two_run.output.find("text from"), std::string::npos) << two_run.output;
  EXPECT_NE(two_run.output.find("tokenized together by 2 ranks, each encoding 1/2 of the documents"), std::string::npos)
      << two_run.output;
  EXPECT_EQ(one.output.find("tokenized together"), std::string::npos) << one.output;
  const std::vector<double> a = losses_of(dir, "one.safetensors"), b = losses_of(dir, "two.safetensors");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i], 1e-5 * a[i]) << "step " << i + 1;
  // Per-source tokens in metrics.jsonl: after step s, 4 s samples of 32 tokens, shared 0.7 / 0.3 within
  // one sample.
  std::ifstream metrics(dir / "one/metrics.jsonl");
  int lines = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.value("kind", "") != "train") continue;
    ++lines;
    const int64_t samples = 4 * j.at("step").get<int64_t>();
    const int64_t corpus = j.at("data_tokens").at("titan_corpus").get<int64_t>(), tok = j.at("data_tokens").at("tok").get<int64_t>();
    EXPECT_EQ(corpus + tok, 32 * samples) << line;
    EXPECT_LE(std::abs(static_cast<double>(corpus) / 32 - 0.7 * static_cast<double>(samples)), 1.0) << line;
  }
  EXPECT_EQ(lines, 6);
  // Saved at step 3 by 2 processes, resumed by one: steps 4-6 as in the run that was not interrupted.
  run(two, args(dir / "resume", 2, 3, {"--checkpoint.enable", "--checkpoint.interval", "3"}), "first.safetensors");
  run({kTitan}, args(dir / "resume", 4, 6, {"--checkpoint.enable", "--checkpoint.interval", "3"}), "rest.safetensors");
  const std::vector<double> rest = losses_of(dir, "rest.safetensors");
  ASSERT_EQ(rest.size(), 3u);
  for (size_t i = 0; i < rest.size(); ++i) EXPECT_NEAR(rest[i], a[i + 3], 1e-5 * a[i + 3]) << "step " << i + 4;
}

}  // namespace
}  // namespace titan
