// The interface every model in the registry implements. Models are plain single-device module
// trees; parallelisms are applied from outside by the model's parallelize hook.
#pragma once

#include "titan/models/common/hooks.h"

#include <torch/nn/module.h>

#include <cstdint>

namespace titan {

class LanguageModelImpl : public nn::HookedModule {
 public:
  // tokens (B, S) int64 -> logits (B, S, V).
  virtual at::Tensor forward(const at::Tensor& tokens_BS) = 0;
  // Fills every parameter as a function of (seed, parameter name) only.
  virtual void init_weights(uint64_t seed) = 0;
  // Training FLOPs per token at sequence length seq_len (torchtitan's formula for this model).
  virtual double flops_per_token(int64_t seq_len) const = 0;
  // Number of token ids the model embeds and predicts.
  virtual int64_t vocab_size() const = 0;
  // Total number of parameter elements (tied tensors counted once).
  int64_t num_params() const;
};

}  // namespace titan
