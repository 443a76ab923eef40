// The interface every model in the registry implements. Models are plain single-device module
// trees; parallelisms are applied from outside by the model's parallelize hook.
#pragma once

#include "titan/nn/hooks.h"
#include "titan/nn/moe.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace titan {

class LanguageModelImpl : public nn::HookedModule {
 public:
  // tokens (B, S) int64 -> logits (B, S, V). A pipeline stage (see ModelSpec::build_stage) maps its
  // input (tokens, or the previous stage's hidden states) to its output (hidden states, or logits);
  // seq_len: the length of the sequence the rank attends with (its context-parallel part, the whole
  // sequence without context parallelism) when the hidden states are one rank's part of it (sequence
  // parallelism), 0 when the input has all of it.
  virtual at::Tensor forward(const at::Tensor& input, int64_t seq_len = 0) = 0;
  // Writes elements [first, first + out.numel()) of the global parameter `name`'s flattened
  // (row-major) initial values into `out` (any dtype and device): values are a function of (seed,
  // name, element) only, so each rank computes just its own part of a sharded parameter.
  virtual void init_elements(uint64_t seed, const std::string& name, at::Tensor out, int64_t first) const = 0;
  // Rows [first_row, first_row + rows.size(0)) (dim 0) of the global parameter `name`.
  void init_rows(uint64_t seed, const std::string& name, at::Tensor rows, int64_t first_row) const;
  // The block of the global parameter `name` that starts at `begin` (one index per dimension) and has
  // out's shape: a tensor-parallel shard, or FSDP's rows of one.
  void init_region(uint64_t seed, const std::string& name, at::Tensor out, const std::vector<int64_t>& begin) const;
  // Fills every parameter that has storage (see tensor_storage.h) with its initial values.
  void init_weights(uint64_t seed);
  // The shape of parameter `name` in the model as built (its global shape once a parallelism has
  // replaced it by a shard: call keep_global_shapes() before resharding).
  std::vector<int64_t> global_shape(const std::string& name) const;
  void keep_global_shapes();
  // Training FLOPs per token at sequence length seq_len (torchtitan's formula for this model).
  virtual double flops_per_token(int64_t seq_len) const = 0;
  // Width of the hidden states between blocks: what crosses between pipeline stages, (B, S, width).
  virtual int64_t hidden_size() const = 0;
  // Number of token ids the model embeds and predicts.
  virtual int64_t vocab_size() const = 0;
  // Total number of parameter elements (tied tensors counted once).
  int64_t num_params() const;
  // The share of parameter `name`'s elements that each token uses (FLOPs count active parameters):
  // 1, or for a mixture of experts' routed expert weights top_k / num_experts.
  virtual double active_share(const std::string& name) const { return 1.0; }
  // The mixture-of-experts layers this instance holds, with their name prefixes ("layers.3.moe."):
  // the trainer updates their routing biases once per step and checkpoints them.
  virtual std::vector<std::pair<std::string, nn::MoEImpl*>> moe_layers() const { return {}; }
  // A parameter that another pipeline stage of the same model also holds: a tied embedding table,
  // which the first stage embeds with and the last stage projects with. The trainer sums the two
  // copies' gradients after backward, so that they stay equal; checkpoints and the gradient norm
  // count the primary copy (the first stage's) only.
  struct SharedParameter {
    std::string name;
    bool primary = true;
  };
  virtual std::vector<SharedParameter> shared_parameters() const { return {}; }

 private:
  std::map<std::string, std::vector<int64_t>> global_shapes_;
};

// The coefficient of the MoE auxiliary load-balancing loss for `model` (model `name` `flavor`):
// model.moe_aux_loss_coeff when set (`configured`), else the flavor's (its MoE layers' options); 0
// for a dense model. Throws UserError when a positive coefficient is set for a dense model.
double moe_aux_loss_coeff(const std::optional<double>& configured, const LanguageModelImpl& model,
                          const std::string& name, const std::string& flavor);

}  // namespace titan
