// Cross-entropy of next-token logits, computed in chunks of tokens.
//
// Shape legend: N tokens (batch x sequence, flattened), V vocabulary.
//
// The plain formulation, at::cross_entropy_loss(logits.to(kFloat), labels), materializes an fp32 copy
// of the whole batch's logits and saves an fp32 log-softmax (N, V) for backward: with bf16 logits
// that is twice the logits' own size held from the forward pass to the backward pass, plus as much
// again in temporaries. cross_entropy_sum saves the logits themselves (their own dtype) and one fp32
// log-sum-exp per token; fp32 exists only for one chunk at a time, in forward and in backward.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace titan::nn {

// Labels equal to this contribute neither loss nor gradient (at::cross_entropy's default).
constexpr int64_t kIgnoreIndex = -100;

// Tokens per chunk by default: fp32 temporaries of 1024 x V x 4 bytes (0.5 GiB for Llama 3's V of 128256).
constexpr int64_t kLossChunkTokens = 1024;

// Sum over tokens of -log softmax(logits_NV[i])[labels_N[i]], skipping labels equal to kIgnoreIndex:
// at::cross_entropy_loss(logits_NV.to(kFloat), labels_N, {}, Sum) with fp32 arithmetic, computed
// chunk_tokens rows at a time in forward and backward. Returns an fp32 scalar; the gradient has
// logits_NV's dtype.
//
// Two formulations of each chunk, equal to fp32 rounding: kComposite (max, subtract, exp, sum, log;
// saves one fp32 log-sum-exp per token and holds one fp32 chunk at a time) and kSoftmax (ATen's fused
// log-softmax kernel forward, recomputed in backward, and its fused backward kernel; three fp32
// chunks at a time in backward). A third, kFused: titan's CUDA kernels (fused_kernels.h), one pass
// over the logits forward and one backward with no fp32 temporaries (chunk_tokens unused). kAuto:
// kFused for the CUDA tensors those kernels take, else kSoftmax on CUDA, where the composite's
// broadcast passes cost twice ATen's fused kernels' time (bench/gpu), kComposite elsewhere.
// (A meta tensor, in titan estimate's dry run, takes the path of the device it stands for:
// common/meta_device.h.)
enum class LossKernels { kAuto, kComposite, kSoftmax, kFused };
at::Tensor cross_entropy_sum(const at::Tensor& logits_NV, const at::Tensor& labels_N,
                             int64_t chunk_tokens = kLossChunkTokens, LossKernels kernels = LossKernels::kAuto);

}  // namespace titan::nn
