#include "launched_training.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>

namespace titan::test {

LaunchedRun run_titan(int nproc, const std::vector<std::string>& args, const TempDir& dir,
                      const std::map<std::string, std::string>& env) {
  std::vector<std::string> argv = {std::string(TITAN_BINARY_DIR) + "/titan"};
  if (nproc > 1) argv.insert(argv.end(), {"launch", "--nproc-per-node", std::to_string(nproc), "--master-port", "0", "--"});
  argv.insert(argv.end(), args.begin(), args.end());
  std::map<std::string, std::string> all = {{"TITAN_DEBUG_DUMP_WEIGHTS", dir / "weights.safetensors"},
                                             {"TITAN_DEBUG_DUMP_COMM", dir / "comm"},
                                             {"OMP_NUM_THREADS", "1"}};
  for (const auto& [k, v] : env) all[k] = v;
  auto r = run_process(argv, all, std::chrono::seconds(600));
  LaunchedRun out;
  out.exit_code = r.exit_code;
  out.output = r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (r.exit_code != 0) return out;
  out.weights = safetensors::load(dir / "weights.safetensors").tensors;
  for (int rank = 0; rank < nproc; ++rank) {
    std::ifstream f(dir / ("comm.rank" + std::to_string(rank) + ".json"));
    out.comm.push_back(nlohmann::json::parse(f));
    // No host read of a device value in the steps that neither log, save nor validate.
    EXPECT_EQ(out.comm.back().at("host_reads_outside_log_steps").get<int64_t>(), 0) << "rank " << rank;
  }
  return out;
}

void expect_same_training(const safetensors::Tensors& ref, const safetensors::Tensors& got, double weight_tol,
                          int first_step) {
  ASSERT_FALSE(ref.empty());
  ASSERT_FALSE(got.empty());
  at::Tensor want = ref.at("__losses__"), have = got.at("__losses__");
  const int64_t steps = have.numel();
  ASSERT_LE(first_step - 1 + steps, want.numel());
  for (int64_t i = 0; i < steps; ++i) {
    const double w = want[first_step - 1 + i].item<double>();
    EXPECT_NEAR(have[i].item<double>(), w, 1e-5 * w) << "step " << first_step + i;
  }
  ASSERT_EQ(got.size(), ref.size());
  if (weight_tol <= 0) return;
  for (const auto& [name, t] : ref) {
    if (name == "__losses__") continue;
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_LE((got.at(name) - t).abs().max().item<double>(), weight_tol) << name;
  }
}

int64_t comm_bytes_per_step(const nlohmann::json& j, const std::string& group, const std::string& op) {
  const auto& b = j.at("bytes");
  if (!b.contains(group) || !b.at(group).contains(op)) return 0;
  return b.at(group).at(op).get<int64_t>() / j.at("steps").get<int64_t>();
}

nlohmann::json qwen3_moe_config() {
  return {{"model_type", "qwen3_moe"},  {"hidden_size", 64},      {"intermediate_size", 96},
          {"num_attention_heads", 4},  {"num_key_value_heads", 2}, {"head_dim", 16},
          {"num_hidden_layers", 3},    {"vocab_size", 2048},      {"num_experts", 8},
          {"num_experts_per_tok", 2},  {"moe_intermediate_size", 32}, {"norm_topk_prob", true},
          {"mlp_only_layers", {0}},    {"rms_norm_eps", 1e-6},    {"rope_theta", 1e6},
          {"tie_word_embeddings", false}};
}

}  // namespace titan::test
