#include "titan/common/grad_norm.h"

#include <ATen/ATen.h>

namespace titan {

at::Tensor grad_sum_of_squares(const std::vector<at::Tensor>& grads) {
  at::NoGradGuard no_grad;
  if (grads.empty()) return at::zeros({}, at::TensorOptions().dtype(at::kDouble));
  // Every gradient's norm in one multi-tensor kernel (CUDA), accumulated in fp64 (ATen's fp32 norm
  // on CPU loses ~1e-5 relative on large tensors), then their squares added up: a few kernels for
  // the whole model, no per-tensor launches or host work.
  const std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2, at::kDouble);
  return at::stack(norms).square().sum();
}

namespace {

// torch.nn.utils.clip_grad_norm_'s coefficient, in the norm's precision (fp64).
at::Tensor clip_coefficient(const at::Tensor& total_norm, double max_norm) {
  return (max_norm / (total_norm + 1e-6)).clamp_max(1.0);
}

}  // namespace

void scale_grads_to_norm(const std::vector<at::Tensor>& grads, const at::Tensor& total_norm, double max_norm) {
  if (max_norm <= 0) return;
  at::NoGradGuard no_grad;
  if (grads.empty()) return;
  at::Tensor coef = clip_coefficient(total_norm, max_norm).to(grads[0].device(), at::kFloat);
  at::_foreach_mul_(grads, coef);  // one multi-tensor kernel, the factor read on the device
}

at::Tensor clip_divisor(const at::Tensor& total_norm, double max_norm) {
  if (max_norm <= 0) return {};
  at::NoGradGuard no_grad;
  return clip_coefficient(total_norm, max_norm).reciprocal().to(at::kFloat);
}

}  // namespace titan
