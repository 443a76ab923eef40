// Chunked cross-entropy (titan/nn/loss.h) against at::cross_entropy_loss on fp32 logits
// with reduction Sum, the formulation the trainer used before.
//
// Tolerances, relative to the tensor's scale: the loss 1e-6 (both sum fp32 terms, in a different
// order and with log-sum-exp rounded once instead of log-softmax); fp32 gradients 1e-6 (softmax from
// exp(x - lse) instead of exp(log_softmax(x))); bf16 gradients 1e-2 (both round the same fp32
// gradient to bf16 once: 2^-7 of an element at most, when the fp32 values differ by ~1e-7 across a
// rounding boundary).
#include "models/graph_memory.h"
#include "test_util.h"

#include "titan/common/meta_device.h"
#include "titan/nn/loss.h"
#include "titan/tools/dry_run.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <cstdio>

namespace titan {
namespace {

at::Tensor plain_loss(const at::Tensor& logits_NV, const at::Tensor& labels_N) {
  return at::cross_entropy_loss(logits_NV.to(at::kFloat), labels_N, {}, at::Reduction::Sum);
}

struct LossAndGrad {
  at::Tensor loss, grad;
};

template <typename F>
LossAndGrad loss_and_grad(F f, const at::Tensor& logits, const at::Tensor& labels, double scale) {
  at::Tensor x = logits.detach().clone().requires_grad_(true);
  at::Tensor loss = f(x, labels);
  (loss * scale).backward();  // a loss scaled like the trainer's (sum / global tokens)
  return {loss.detach(), x.grad()};
}

// Labels with every 5th token ignored (-100), as packed documents' padding would be.
at::Tensor labels_with_ignored(int64_t N, int64_t V) {
  at::Tensor y = at::randint(V, {N}, at::kLong);
  y.slice(0, 0, N, 5).fill_(nn::kIgnoreIndex);
  return y;
}

// Both formulations run on every device (kAuto picks them only on the CPU, kComposite, and on CUDA
// for tensors the fused kernels do not take, kSoftmax; the fused kernels are CudaFusedKernels' tests).
const std::pair<nn::LossKernels, const char*> kBothKernels[] = {{nn::LossKernels::kComposite, "composite"},
                                                                 {nn::LossKernels::kSoftmax, "softmax"}};

TEST(ChunkedCrossEntropy, EqualsATenCrossEntropyForEveryChunkSize) {
  at::manual_seed(0);
  const int64_t N = 37, V = 211;
  at::Tensor labels = labels_with_ignored(N, V);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    at::Tensor logits = (at::randn({N, V}) * 4).to(dt);
    LossAndGrad ref = loss_and_grad(plain_loss, logits, labels, 1.0 / N);
    for (auto [kernels, name] : kBothKernels)
    for (int64_t chunk : {int64_t{1}, int64_t{7}, N, int64_t{1024}}) {
      LossAndGrad got = loss_and_grad(
          [&](const at::Tensor& x, const at::Tensor& y) { return nn::cross_entropy_sum(x, y, chunk, kernels); },
          logits, labels, 1.0 / N);
      const std::string what = std::string(at::toString(dt)) + " " + name + " chunk " + std::to_string(chunk);
      EXPECT_EQ(got.loss.scalar_type(), at::kFloat) << what;
      EXPECT_EQ(got.grad.scalar_type(), dt) << what;
      EXPECT_LE(test::relative_error(got.loss, ref.loss), 1e-6) << what;
      const double err = test::relative_error(got.grad, ref.grad);
      EXPECT_LE(err, dt == at::kFloat ? 1e-6 : 1e-2) << what;
      std::printf("[%s] loss %.7f vs %.7f, gradient relative error %.2e\n", what.c_str(), got.loss.item<double>(),
                  ref.loss.item<double>(), err);
    }
  }
}

TEST(ChunkedCrossEntropy, IgnoredTokensGetNoLossAndNoGradient) {
  at::manual_seed(0);
  const int64_t N = 12, V = 50;
  at::Tensor logits = at::randn({N, V}) * 4;
  at::Tensor labels = labels_with_ignored(N, V);
  for (auto [kernels, name] : kBothKernels) {
  SCOPED_TRACE(name);
  auto loss = [kernels = kernels](const at::Tensor& x, const at::Tensor& y) {
    return nn::cross_entropy_sum(x, y, 5, kernels);
  };
  LossAndGrad got = loss_and_grad(loss, logits, labels, 1.0);
  at::Tensor ignored = labels.eq(nn::kIgnoreIndex);
  EXPECT_TRUE(at::equal(got.grad.index({ignored}), at::zeros({ignored.sum().item<int64_t>(), V})));
  // The loss is the sum over the labelled tokens only.
  at::Tensor kept = ignored.logical_not();
  LossAndGrad only_kept = loss_and_grad(plain_loss, logits.index({kept}), labels.index({kept}), 1.0);
  EXPECT_LE(test::relative_error(got.loss, only_kept.loss), 1e-6);
  // All ignored: zero loss, zero gradient.
  at::Tensor none = at::full({N}, nn::kIgnoreIndex, at::kLong);
  LossAndGrad zero = loss_and_grad(loss, logits, none, 1.0);
  EXPECT_EQ(zero.loss.item<double>(), 0.0);
  EXPECT_TRUE(at::equal(zero.grad, at::zeros_like(logits)));
  }
}

TEST(ChunkedCrossEntropy, RejectsMisshapenInputs) {
  at::Tensor logits = at::randn({4, 10});
  EXPECT_THROW(nn::cross_entropy_sum(logits, at::zeros({3}, at::kLong)), c10::Error);
  EXPECT_THROW(nn::cross_entropy_sum(logits.unsqueeze(0), at::zeros({4}, at::kLong)), c10::Error);
  EXPECT_THROW(nn::cross_entropy_sum(logits, at::zeros({4}, at::kLong), 0), c10::Error);
}

// In titan estimate's dry run the loss allocates what it allocates on the device estimated. Standing
// for CUDA: titan's fused kernels, whose forward writes two fp32 values per token (keeping one) and
// whose backward writes the logits' gradient, with no fp32 (chunk, V) temporary. Standing for the CPU:
// the chunked formulation's fp32 chunks (at least one chunk forward, and one beside the gradient in
// backward).
TEST(LossMemory, DryRunAllocatesAsTheDeviceItStandsFor) {
  const int64_t N = 256, V = 4096, chunk = 64;
  for (const bool cuda : {true, false}) {
    SCOPED_TRACE(cuda ? "standing for CUDA" : "standing for the CPU");
    MetaStandsForCpu standing(!cuda);
    DryRunDevice counting;
    const auto meta = at::TensorOptions().device(at::kMeta);
    const at::Tensor logits = at::empty({N, V}, meta.dtype(at::kBFloat16)).requires_grad_(true);
    const at::Tensor labels = at::empty({N}, meta.dtype(at::kLong));
    const int64_t start = counting.current();
    counting.reset_peak();
    at::Tensor loss = nn::cross_entropy_sum(logits, labels, chunk);
    const int64_t forward = counting.peak() - start, kept = counting.current() - start;
    const int64_t before_backward = counting.current();
    counting.reset_peak();
    loss.backward();
    const int64_t backward = counting.peak() - before_backward;
    const int64_t grad = N * V * 2, fp32_chunk = chunk * V * 4;
    EXPECT_GE(backward, grad) << backward;
    if (cuda) {
      EXPECT_EQ(kept, N * 4 + 4);  // the log-sum-exp per token, and the loss
      EXPECT_LE(forward, 2 * N * 4 + 64) << forward;
      EXPECT_LE(backward, grad + 64) << backward;
    } else {
      EXPECT_GE(forward, fp32_chunk) << forward;
      EXPECT_GE(backward, grad + fp32_chunk) << backward;
    }
  }
}

// bf16 logits of 512 tokens over 4096 words, chunks of 64 tokens. Plain: saves the fp32 log-softmax
// (twice the bf16 logits) and peaks with the bf16 logits, their fp32 copy and the fp32 log-softmax
// alive in forward, three fp32 (N, V) tensors in backward. Lean: saves the bf16 logits and one fp32
// per token; fp32 exists for one chunk at a time. (Both peaks include the measurement's own bf16
// gradient of the logits' copy.)
TEST(LossMemory, ChunkedCrossEntropySavesBf16LogitsAndPeaksFarLower) {
  const int64_t N = 512, V = 4096;
  at::Tensor logits = (at::randn({N, V}) * 4).to(at::kBFloat16).requires_grad_(true);
  at::Tensor labels = labels_with_ignored(N, V);
  auto lean = test::measure_graph([&](const auto& in) { return nn::cross_entropy_sum(in[0], in[1], 64); },
                                  {logits, labels});
  auto plain = test::measure_graph([&](const auto& in) { return plain_loss(in[0], in[1]); }, {logits, labels});
  std::printf("[cross-entropy bf16 N=%lld V=%lld] saved: lean %lld B, plain %lld B (%.2f); peak: lean %lld B, "
              "plain %lld B (%.2f)\n",
              static_cast<long long>(N), static_cast<long long>(V), static_cast<long long>(lean.saved),
              static_cast<long long>(plain.saved), static_cast<double>(lean.saved) / static_cast<double>(plain.saved),
              static_cast<long long>(lean.peak), static_cast<long long>(plain.peak),
              static_cast<double>(lean.peak) / static_cast<double>(plain.peak));
  EXPECT_LE(lean.saved, plain.saved * 55 / 100);
  EXPECT_LE(lean.peak, plain.peak / 2);
}

// fp32 logits: both keep one fp32 (N, V) tensor (the logits, or the log-softmax); the lean one
// needs no (N, V) temporary besides the gradient.
TEST(LossMemory, ChunkedCrossEntropyPeaksLowerOnFp32LogitsToo) {
  const int64_t N = 512, V = 4096;
  at::Tensor logits = (at::randn({N, V}) * 4).requires_grad_(true);
  at::Tensor labels = labels_with_ignored(N, V);
  auto lean = test::measure_graph([&](const auto& in) { return nn::cross_entropy_sum(in[0], in[1], 64); },
                                  {logits, labels});
  auto plain = test::measure_graph([&](const auto& in) { return plain_loss(in[0], in[1]); }, {logits, labels});
  std::printf("[cross-entropy fp32] saved: lean %lld B, plain %lld B; peak: lean %lld B, plain %lld B\n",
              static_cast<long long>(lean.saved), static_cast<long long>(plain.saved),
              static_cast<long long>(lean.peak), static_cast<long long>(plain.peak));
  EXPECT_LE(lean.saved, plain.saved * 101 / 100);
  EXPECT_LE(lean.peak, plain.peak * 75 / 100);
}

}  // namespace
}  // namespace titan
