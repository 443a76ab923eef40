#include "titan/nn/loss.h"

#include "titan/common/meta_device.h"
#include "titan/nn/fused_kernels.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>

namespace titan::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// x - s in fp32, as a new (C, V) tensor: for fp32 x one pass; otherwise an fp32 copy rewritten in
// place (subtracting directly would also promote x, but the CPU does that through a temporary copy).
at::Tensor fp32_minus(const at::Tensor& x_CV, const at::Tensor& s_C1) {
  return x_CV.scalar_type() == at::kFloat ? x_CV - s_C1 : x_CV.to(at::kFloat).sub_(s_C1);
}

// log(sum(exp(x))) over rows in fp32, as at::logsumexp computes it (max subtracted; an infinite max
// counts as 0), with one fp32 (C, V) temporary.
at::Tensor log_sum_exp(const at::Tensor& x_CV) {
  at::Tensor max_C1 = x_CV.amax(1, /*keepdim=*/true).to(at::kFloat);
  max_C1.masked_fill_(max_C1.abs() == INFINITY, 0.0);
  return fp32_minus(x_CV, max_C1).exp_().sum(1).log_().add_(max_C1.squeeze(1));
}

// Labels with ignored rows pointing at column 0 (their contributions are masked separately).
at::Tensor safe_labels(const at::Tensor& y_C, const at::Tensor& valid_C) {
  return y_C.masked_fill(valid_C.logical_not(), 0).unsqueeze(1);
}

// The kSoftmax formulation: -log_softmax(x)[y] forward; backward through ATen's log-softmax backward
// kernel with the gradient of the log-probabilities, -g at each valid row's label and 0 elsewhere, so
// that the kernel's g_lp - exp(lp) * sum(g_lp) is g * (softmax(x) - onehot(y)) on valid rows, 0 else.
struct SoftmaxCrossEntropySumFunction : public torch::autograd::Function<SoftmaxCrossEntropySumFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits_NV, const at::Tensor& labels_N,
                            int64_t chunk) {
    const int64_t N = logits_NV.size(0);
    at::Tensor loss = at::zeros({}, logits_NV.options().dtype(at::kFloat));
    for (int64_t a = 0; a < N; a += chunk) {
      const int64_t b = std::min(N, a + chunk);
      const at::Tensor y_C = labels_N.slice(0, a, b);
      const at::Tensor valid_C = y_C.ne(kIgnoreIndex);
      const at::Tensor lp_CV = at::log_softmax(logits_NV.slice(0, a, b), 1, at::kFloat);
      loss.sub_(at::where(valid_C, lp_CV.gather(1, safe_labels(y_C, valid_C)).squeeze(1), 0.0).sum());
    }
    ctx->save_for_backward({logits_NV});
    ctx->saved_data["labels"] = labels_N;
    ctx->saved_data["chunk"] = chunk;
    return loss;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor logits_NV = ctx->get_saved_variables()[0];
    const at::Tensor labels_N = ctx->saved_data["labels"].toTensor();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const at::Tensor minus_g = grads[0].to(at::kFloat).neg();  // on the device: no host synchronization
    const int64_t N = logits_NV.size(0);
    at::Tensor grad_NV = at::empty_like(logits_NV, at::MemoryFormat::Contiguous);
    for (int64_t a = 0; a < N; a += chunk) {
      const int64_t b = std::min(N, a + chunk);
      const at::Tensor y_C = labels_N.slice(0, a, b);
      const at::Tensor valid_C = y_C.ne(kIgnoreIndex);
      const at::Tensor lp_CV = at::log_softmax(logits_NV.slice(0, a, b), 1, at::kFloat);
      at::Tensor g_lp_CV = at::zeros_like(lp_CV);
      g_lp_CV.scatter_(1, safe_labels(y_C, valid_C), at::where(valid_C, minus_g, 0.0).unsqueeze(1));
      // In fp32, rounded once to the logits' dtype by the copy.
      grad_NV.slice(0, a, b).copy_(at::_log_softmax_backward_data(g_lp_CV, lp_CV, 1, at::kFloat));
    }
    return {grad_NV, at::Tensor(), at::Tensor()};
  }
};

// The kFused formulation: titan's CUDA kernels, one read of the logits forward (a running
// log-sum-exp per row) and one read and one write backward; no fp32 temporaries, so no chunks.
// (On a meta tensor standing for CUDA, titan estimate's dry run, what the kernels allocate.)
struct FusedCrossEntropySumFunction : public torch::autograd::Function<FusedCrossEntropySumFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits_NV, const at::Tensor& labels_N) {
    const auto f32 = logits_NV.options().dtype(at::kFloat);
    auto [lse_N, loss_N] = logits_NV.is_meta()
                               ? std::make_pair(at::empty({logits_NV.size(0)}, f32), at::empty({logits_NV.size(0)}, f32))
                               : fused::cross_entropy_forward(logits_NV, labels_N, kIgnoreIndex);
    ctx->save_for_backward({logits_NV});
    ctx->saved_data["labels"] = labels_N;
    ctx->saved_data["lse"] = lse_N;
    return loss_N.sum();
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor logits_NV = ctx->get_saved_variables()[0];
    if (logits_NV.is_meta()) return {at::empty(logits_NV.sizes(), logits_NV.options()), at::Tensor()};
    return {fused::cross_entropy_backward(logits_NV, ctx->saved_data["labels"].toTensor(),
                                          ctx->saved_data["lse"].toTensor(), grads[0], kIgnoreIndex),
            at::Tensor()};
  }
};

struct CrossEntropySumFunction : public torch::autograd::Function<CrossEntropySumFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits_NV, const at::Tensor& labels_N,
                            int64_t chunk) {
    const int64_t N = logits_NV.size(0);
    const auto f32 = logits_NV.options().dtype(at::kFloat);
    at::Tensor lse_N = at::empty({N}, f32);
    at::Tensor loss = at::zeros({}, f32);
    for (int64_t a = 0; a < N; a += chunk) {
      const int64_t b = std::min(N, a + chunk);
      const at::Tensor x_CV = logits_NV.slice(0, a, b);
      const at::Tensor y_C = labels_N.slice(0, a, b);
      const at::Tensor valid_C = y_C.ne(kIgnoreIndex);
      at::Tensor lse_C = log_sum_exp(x_CV);
      // -log softmax(x)[y] = lse - x[y]; ignored rows gather column 0 and are dropped by the where.
      at::Tensor picked_C =
          x_CV.gather(1, y_C.masked_fill(valid_C.logical_not(), 0).unsqueeze(1)).squeeze(1).to(at::kFloat);
      loss.add_(at::where(valid_C, lse_C - picked_C, 0.0).sum());
      lse_N.slice(0, a, b).copy_(lse_C);
    }
    ctx->save_for_backward({logits_NV});
    ctx->saved_data["labels"] = labels_N;
    ctx->saved_data["lse"] = lse_N;
    ctx->saved_data["chunk"] = chunk;
    return loss;
  }

  // d loss / d x = g * (softmax(x) - onehot(y)) on rows with a label, 0 on ignored rows.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor logits_NV = ctx->get_saved_variables()[0];
    const at::Tensor labels_N = ctx->saved_data["labels"].toTensor();
    const at::Tensor lse_N = ctx->saved_data["lse"].toTensor();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const at::Tensor g = grads[0].to(at::kFloat);  // scalar, on the device (no host synchronization)
    const int64_t N = logits_NV.size(0);
    at::Tensor grad_NV = at::empty_like(logits_NV, at::MemoryFormat::Contiguous);
    for (int64_t a = 0; a < N; a += chunk) {
      const int64_t b = std::min(N, a + chunk);
      const at::Tensor y_C = labels_N.slice(0, a, b);
      const at::Tensor valid_C = y_C.ne(kIgnoreIndex);
      at::Tensor p_CV = fp32_minus(logits_NV.slice(0, a, b), lse_N.slice(0, a, b).unsqueeze(1)).exp_();
      p_CV.scatter_add_(1, y_C.masked_fill(valid_C.logical_not(), 0).unsqueeze(1),
                        valid_C.to(at::kFloat).neg_().unsqueeze(1));
      p_CV.mul_(at::where(valid_C, g, 0.0).unsqueeze(1));
      grad_NV.slice(0, a, b).copy_(p_CV);  // rounded to the logits' dtype
    }
    return {grad_NV, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor cross_entropy_sum(const at::Tensor& logits_NV, const at::Tensor& labels_N, int64_t chunk_tokens,
                             LossKernels kernels) {
  TORCH_CHECK(logits_NV.dim() == 2 && labels_N.dim() == 1 && labels_N.size(0) == logits_NV.size(0),
              "cross_entropy_sum takes logits (N, V) and labels (N,), got ", logits_NV.sizes(), " and ",
              labels_N.sizes());
  TORCH_CHECK(chunk_tokens > 0, "cross_entropy_sum: chunk_tokens must be positive, got ", chunk_tokens);
  // A meta tensor takes the path of the device it stands for (titan estimate's dry run).
  // (A CUDA build of titan always has its kernels: a meta tensor standing for CUDA takes them.)
  const bool meta_cuda = logits_NV.is_meta() && meta_is_cuda();
  const bool fused_take = fused::cross_entropy_accepts(logits_NV, labels_N) ||
                          (meta_cuda && fused::cross_entropy_shapes(logits_NV, labels_N));
  if (kernels == LossKernels::kAuto) {
    kernels = fused_take                         ? LossKernels::kFused
              : logits_NV.is_cuda() || meta_cuda ? LossKernels::kSoftmax
                                                 : LossKernels::kComposite;
  }
  if (kernels == LossKernels::kFused) {
    TORCH_CHECK(fused_take,
                "cross_entropy_sum: the fused kernels take CUDA "
                "logits (N, V) of float32, bfloat16 or float16 with contiguous rows and int64 labels on their device");
    return FusedCrossEntropySumFunction::apply(logits_NV, labels_N);
  }
  if (kernels == LossKernels::kSoftmax) return SoftmaxCrossEntropySumFunction::apply(logits_NV, labels_N, chunk_tokens);
  return CrossEntropySumFunction::apply(logits_NV, labels_N, chunk_tokens);
}

}  // namespace titan::nn
