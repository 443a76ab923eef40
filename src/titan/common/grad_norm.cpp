#include "titan/common/grad_norm.h"

#include <ATen/ATen.h>

namespace titan {

at::Tensor grad_sum_of_squares(const std::vector<at::Tensor>& grads) {
  at::NoGradGuard no_grad;
  // Sum of squares per gradient through dot products (blocked accumulation: ATen's fp32 norm kernel
  // on CPU loses ~1e-5 relative on large tensors), added up in fp64.
  at::Tensor sum_sq = at::zeros({}, at::TensorOptions().dtype(at::kDouble).device(grads.empty() ? at::kCPU : grads[0].device()));
  for (const auto& g : grads) {
    at::Tensor flat = g.to(at::kFloat).contiguous().view({-1});
    sum_sq += at::dot(flat, flat).to(sum_sq.device(), at::kDouble);
  }
  return sum_sq;
}

void scale_grads_to_norm(const std::vector<at::Tensor>& grads, const at::Tensor& total_norm, double max_norm) {
  if (max_norm <= 0) return;
  at::NoGradGuard no_grad;
  at::Tensor coef = (max_norm / (total_norm + 1e-6)).clamp_max(1.0).to(at::kFloat);
  for (auto g : grads) g.mul_(coef.to(g.device()));
}

}  // namespace titan
