// The interface every model in the registry implements. Models are plain single-device module
// trees; parallelisms are applied from outside by the model's parallelize hook.
#pragma once

#include "titan/models/common/hooks.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <string>

namespace titan {

class LanguageModelImpl : public nn::HookedModule {
 public:
  // tokens (B, S) int64 -> logits (B, S, V).
  virtual at::Tensor forward(const at::Tensor& tokens_BS) = 0;
  // Writes rows [first_row, first_row + rows.size(0)) (dim 0 of the global parameter `name`) of that
  // parameter's initial values into `rows` (any dtype and device): values are a function of (seed,
  // name, element) only, so FSDP computes just the rows of a rank's shard.
  virtual void init_rows(uint64_t seed, const std::string& name, at::Tensor rows, int64_t first_row) const = 0;
  // Fills every parameter that has storage (see tensor_storage.h) with init_rows.
  void init_weights(uint64_t seed);
  // Training FLOPs per token at sequence length seq_len (torchtitan's formula for this model).
  virtual double flops_per_token(int64_t seq_len) const = 0;
  // Number of token ids the model embeds and predicts.
  virtual int64_t vocab_size() const = 0;
  // Total number of parameter elements (tied tensors counted once).
  int64_t num_params() const;
};

}  // namespace titan
