#include "titan/tools/estimate.h"

#include "titan/models/registry.h"

#include <ATen/ATen.h>

#include <cstdio>
#include <sstream>

namespace titan {
namespace {

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

std::string gib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

}  // namespace

ModelEstimate estimate_model(const std::string& model, const std::string& flavor, int64_t seq_len) {
  const ModelSpec& spec = model_spec(model);
  LanguageModel m = spec.build(flavor, at::TensorOptions().device(at::kMeta).dtype(at::kFloat), seq_len);
  ModelEstimate e;
  e.model = model;
  e.flavor = flavor;
  e.seq_len = seq_len;
  e.params = m->num_params();
  e.flops_per_token = m->flops_per_token(seq_len);
  e.param_bytes = e.params * 4;
  e.grad_bytes = e.params * 4;
  e.optimizer_bytes = e.params * 8;
  return e;
}

std::string format_estimate(const ModelEstimate& e) {
  std::ostringstream os;
  char flops[64];
  std::snprintf(flops, sizeof flops, "%.4e", e.flops_per_token);
  os << "model: " << e.model << " " << e.flavor << "\n"
     << "parameters: " << with_commas(e.params) << "\n"
     << "training FLOPs per token (seq_len " << e.seq_len << "): " << flops << "\n"
     << "parameters, fp32: " << gib(e.param_bytes) << "\n"
     << "gradients, fp32: " << gib(e.grad_bytes) << "\n"
     << "AdamW state (exp_avg, exp_avg_sq), fp32: " << gib(e.optimizer_bytes) << "\n"
     << "total before activations: " << gib(e.param_bytes + e.grad_bytes + e.optimizer_bytes)
     << " (divide by the FSDP degree for per-rank figures)\n";
  return os.str();
}

}  // namespace titan
