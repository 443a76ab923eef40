// Adam / AdamW over a model's named parameters, with torchtitan's defaults and PyTorch's update rule.
//
// implementation "fused": ATen's _fused_adam(w)_ kernels (CPU and CUDA), one call per (device, dtype)
// group; "for-loop": the same update written with per-tensor ATen ops (the readable reference).
// Adam's weight_decay is L2 added to the gradient; AdamW's is decoupled (w -= lr * wd * w).
// State per parameter: exp_avg, exp_avg_sq (same dtype as the parameter) and the step count, created
// (zeros) at the first step or when first read or loaded through state_dict/load_state_dict.
#pragma once

#include "titan/config/sections_train.h"

#include <ATen/core/Tensor.h>

#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace titan {

struct OptimizerOptions {
  std::string name = "AdamW";  // "AdamW" | "Adam"
  double lr = 8e-4;
  double beta1 = 0.9, beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  std::string implementation = "fused";  // "fused" | "for-loop"
};

// The [optimizer] section's options. Throws UserError for implementation "foreach", which titan
// does not implement (fused and for-loop compute the same update).
OptimizerOptions optimizer_options(const config::Optimizer& section);

class Optimizer {
 public:
  // Throws UserError for an unknown name or implementation.
  Optimizer(std::vector<std::pair<std::string, at::Tensor>> named_params, OptimizerOptions opts);

  // One update of every parameter that has a gradient, at the current learning rate.
  // skip: a float scalar (any device); 1 leaves parameters, moments and step counts unchanged. The
  // fused kernels read it on the device, so deciding to skip needs no host synchronization.
  // grad_divisor: an fp32 scalar (any device) every gradient is divided by first, in place (gradient
  // clipping, dist::grad_norm_and_clip_divisor): the fused kernels divide as they read each gradient,
  // so clipping costs no pass of its own; undefined: none.
  void step(const std::optional<at::Tensor>& skip = std::nullopt, const at::Tensor& grad_divisor = {});
  void zero_grad();  // drops the gradients (set to undefined), like set_to_none=True
  // optimizer.early_step_in_backward: the update of step() for `params` only (each one of this
  // optimizer's parameters, by identity; those without a gradient are left alone), inside the
  // backward as their gradients become final. skip as for step(). A training step's calls together
  // update each parameter once; end_step() then counts the step.
  void step_parameters(const std::vector<at::Tensor>& params, const std::optional<at::Tensor>& skip = std::nullopt);
  void end_step() { ++steps_; }
  // Creates the state now (zeros) rather than at the first update: early_step_in_backward's first
  // updates run inside a backward, where the activations are alive.
  void create_state() const { ensure_state(); }

  double lr() const { return lr_; }
  void set_lr(double lr) { lr_ = lr; }
  const OptimizerOptions& options() const { return opts_; }
  int64_t steps_taken() const { return steps_; }
  // The parameters it steps, by name (shards under FSDP).
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;

  // Flat state by parameter name: "<name>.exp_avg", "<name>.exp_avg_sq", "<name>.step".
  std::map<std::string, at::Tensor> state_dict() const;
  void load_state_dict(const std::map<std::string, at::Tensor>& state);

 private:
  struct ParamState {
    std::string name;
    at::Tensor param, exp_avg, exp_avg_sq, step;  // step: fp32 scalar on the parameter's device
  };
  void ensure_state() const;
  void update(const std::vector<ParamState*>& states, const std::optional<at::Tensor>& skip,
              const at::Tensor& grad_divisor = {});
  void step_fused(const std::vector<ParamState*>& group, const std::optional<at::Tensor>& skip,
                  const at::Tensor& grad_divisor);
  void step_for_loop(ParamState& s);

  OptimizerOptions opts_;
  double lr_;
  int64_t steps_ = 0;
  bool decoupled_;
  mutable bool state_ready_ = false;
  mutable std::vector<ParamState> params_;
  std::unordered_map<const void*, size_t> index_;  // parameter (TensorImpl) -> its entry in params_
};

// Clips gradients in place so that their global L2 norm is at most max_norm (like
// torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1).
// `reduce_sum_of_squares`, if given, sums the local sum of squares across ranks (sharded gradients).
// Returns the norm before clipping. max_norm <= 0 only measures.
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm,
                      const std::function<void(at::Tensor&)>& reduce_sum_of_squares = {});

}  // namespace titan
