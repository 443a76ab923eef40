// Activation checkpointing in training: the losses of none, full and selective (every 2nd block) are
// identical (per operator and memory_budget: to fp32 rounding), and the measured peak memory orders
// none > selective > full, none > per operator > full and none > memory_budget 0.4 > full.
#include "test_util.h"

#include "titan/config/job_config.h"
#include "titan/trainer/trainer.h"

#include <gtest/gtest.h>

#include <regex>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";

// mode: none, full, selective (every 2nd block), op (torchtitan's per-operator policy), op_all
// (per operator, every matmul kept) or budget (memory_budget 0.4: blocks in full and per operator).
std::vector<std::string> args(const std::string& dump, const std::string& mode, int seq_len, int steps) {
  const bool op = mode.rfind("op", 0) == 0;
  return {"--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder", dump,
          "--model.hf_assets_path", kSource + "/assets/tokenizer", "--training.seq_len", std::to_string(seq_len),
          "--training.local_batch_size", "4", "--training.steps", std::to_string(steps), "--metrics.log_freq", "1",
          "--activation_checkpoint.mode", op ? "selective" : mode == "budget" ? "memory_budget" : mode,
          "--activation_checkpoint.selective_ac_option", op ? "op" : "2",
          "--activation_checkpoint.per_op_policy", mode == "op_all" ? "all_matmuls" : "every_other_matmul",
          "--activation_checkpoint.memory_budget", "0.4"};
}

TEST(ActivationCheckpointTraining, LossesAreIdenticalInEveryMode) {
  std::vector<std::vector<double>> losses;
  for (const std::string mode : {"none", "full", "selective", "op", "op_all", "budget"}) {
    test::TempDir dir;
    Trainer t(parse_config(args(dir.path(), mode, 32, 10)));
    losses.push_back(t.train());
  }
  EXPECT_EQ(losses[1], losses[0]) << "full";
  EXPECT_EQ(losses[2], losses[0]) << "selective";
  // Per operator: kept matmuls back-propagate with written-out formulas (fp32 rounding).
  for (size_t i = 0; i < losses[0].size(); ++i) {
    EXPECT_NEAR(losses[3][i], losses[0][i], 1e-5 * losses[0][i]) << "op " << i;
    EXPECT_NEAR(losses[4][i], losses[0][i], 1e-5 * losses[0][i]) << "op, all matmuls " << i;
    EXPECT_NEAR(losses[5][i], losses[0][i], 1e-5 * losses[0][i]) << "memory budget " << i;
  }
}

// Peak memory (the log line's figure: on CPU the peak bytes of tensors, counted by the allocator) of 3 steps at
// sequence length 1024, where the activations of the 6 blocks (~0.5 GiB) dominate.
double peak_gib(const std::string& mode) {
  test::TempDir dir;
  std::vector<std::string> argv = {kTitan, "train"};
  for (const auto& a : args(dir.path(), mode, 1024, 3)) argv.push_back(a);
  auto r = test::run_process(argv, {{"OMP_NUM_THREADS", "2"}}, std::chrono::seconds(600));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  double peak = 0;
  std::string rest = r.output;
  static const std::regex memory(R"(memory:\s*([\d.]+)GiB)");
  while (std::regex_search(rest, m, memory)) {
    peak = std::max(peak, std::stod(m[1]));
    rest = m.suffix();
  }
  return peak;
}

TEST(ActivationCheckpointTraining, MeasuredPeakMemoryOrdersNoneSelectiveFull) {
  const double none = peak_gib("none"), selective = peak_gib("selective"), op = peak_gib("op"), full = peak_gib("full"),
               budget = peak_gib("budget");
  std::printf("peak memory: none %.2f GiB, selective (every 2nd block) %.2f GiB, per operator %.2f GiB, full %.2f GiB, "
              "memory budget 0.4 %.2f GiB\n",
              none, selective, op, full, budget);
  EXPECT_GT(none, budget + 0.05);
  EXPECT_GT(budget, full + 0.05);
  EXPECT_GT(none, selective + 0.05);
  EXPECT_GT(selective, full + 0.05);
  EXPECT_GT(none, op + 0.05);
  EXPECT_GT(op, full + 0.05);
}

}  // namespace
}  // namespace titan
