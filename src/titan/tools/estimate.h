// `titan estimate`: size and cost of a model flavor, computed on a shape-only (meta) model so that
// even 405B needs no memory for weights.
#pragma once

#include <cstdint>
#include <string>

namespace titan {

struct ModelEstimate {
  std::string model, flavor;
  int64_t seq_len = 0;
  int64_t params = 0;            // all parameter elements (tied tensors once)
  double flops_per_token = 0;    // training (forward + backward), torchtitan's formula
  int64_t param_bytes = 0;       // fp32 master weights
  int64_t grad_bytes = 0;        // fp32 gradients
  int64_t optimizer_bytes = 0;   // AdamW exp_avg + exp_avg_sq, fp32
};

ModelEstimate estimate_model(const std::string& model, const std::string& flavor, int64_t seq_len);
// Human-readable report, one quantity per line.
std::string format_estimate(const ModelEstimate& e);

}  // namespace titan
