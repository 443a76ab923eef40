// Training runs through the real `titan` binary (with `titan launch` for several processes), for
// tests that compare a parallel layout with one process training alone.
#pragma once

#include "test_util.h"

#include "titan/components/checkpoint/safetensors.h"

#include <nlohmann/json.hpp>

#include <map>
#include <string>
#include <vector>

namespace titan::test {

struct LaunchedRun {
  int exit_code = -1;
  std::string output;
  safetensors::Tensors weights;      // TITAN_DEBUG_DUMP_WEIGHTS: the final weights and "__losses__"
  std::vector<nlohmann::json> comm;  // TITAN_DEBUG_DUMP_COMM, per rank
};

// Runs `titan args...` in nproc processes (one: without the launcher), with one thread per process
// and `env` added, and reads what it dumped into `dir`. A failed run is a test failure (its output in
// the message).
LaunchedRun run_titan(int nproc, const std::vector<std::string>& args, const TempDir& dir,
                      const std::map<std::string, std::string>& env = {});

// `got` trained as `ref` did: the losses of steps first_step .. first_step + n - 1 (got holds n of
// them) within 1e-5 relative of ref's, and, when `weight_tol` > 0, every final weight within
// weight_tol (absolute) of ref's.
void expect_same_training(const safetensors::Tensors& ref, const safetensors::Tensors& got, double weight_tol,
                          int first_step = 1);

// Bytes per step that rank `j` (a dumped comm record) moved on mesh dimension `group` by `op`.
int64_t comm_bytes_per_step(const nlohmann::json& j, const std::string& group, const std::string& op);

// A small Qwen3-MoE (a dense first layer, then two layers of 8 experts, 2 per token) as config.json
// text, for --model.flavor.
nlohmann::json qwen3_moe_config();

}  // namespace titan::test
