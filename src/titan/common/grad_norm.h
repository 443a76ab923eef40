// The two halves of gradient-norm clipping, shared by the single-device and the placement-aware
// (distributed/placement.h) versions.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace titan {

// The sum of squares of `grads` in fp64 (a 0-dim tensor on their device; CPU when empty).
at::Tensor grad_sum_of_squares(const std::vector<at::Tensor>& grads);
// Scales `grads` in place by min(1, max_norm / (total_norm + 1e-6)); nothing when max_norm <= 0.
void scale_grads_to_norm(const std::vector<at::Tensor>& grads, const at::Tensor& total_norm, double max_norm);
// What scale_grads_to_norm multiplies by, as a divisor: 1 / min(1, max_norm / (total_norm + 1e-6)), an
// fp32 scalar on total_norm's device (for the optimizer's fused kernels, which divide each gradient
// as they read it); undefined when max_norm <= 0.
at::Tensor clip_divisor(const at::Tensor& total_norm, double max_norm);

}  // namespace titan
