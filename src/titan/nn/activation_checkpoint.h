// Activation checkpointing: a module's body runs in forward without recording a graph (only its
// inputs are kept), and runs again in backward, with the graph, to back-propagate through it (like
// torch.utils.checkpoint with use_reentrant=True). Gradients are those of the plain body: the
// recomputation repeats the same operations on the same values (no randomness in the bodies it wraps).
// Autocast (CUDA and CPU) is restored for the recomputation as it was in forward.
//
// Per-operator policies (torchtitan's selective_ac_option "op"): the body's expensive operations
// keep their outputs from the forward; the recomputation in backward runs only what lies between
// them and takes the kept outputs instead of running those operations again.
//   every_other_matmul (torchtitan's policy, the default "op"): the 1st, 3rd, 5th ... matmul of the
//     body (nn::saveable_linear, every Linear) keeps its output, the others are recomputed; every
//     attention (nn::saveable_attention) keeps its output and log-sum-exp.
//   all_matmuls: every matmul and attention keeps its output (more memory, less recomputation).
// A kept matmul back-propagates with its own formulas (grad_x = g W, grad_W = gᵀ x); a kept attention
// back-propagates through its backward kernel from the kept output and log-sum-exp, so attention's
// forward never runs again (nor, under context parallelism, the ring's forward exchange of K/V).
#pragma once

#include "titan/nn/hooks.h"
#include "titan/nn/layers.h"

namespace titan::nn {

enum class SaveOps { None, EveryOtherMatmul, AllMatmuls };

struct CheckpointOptions {
  SaveOps save = SaveOps::None;
  // torchtitan's determinism_check "default": the recomputation's output must have the forward
  // output's shape, dtype and device, else backward stops with an error naming `name` (a body that
  // computes something else when run again); false ("none"): no check.
  bool check_recompute = true;
  std::string name = "a checkpointed module";
};

// Runs `body(inputs)` checkpointed: see above. Without grad mode it simply runs the body.
at::Tensor checkpoint(const HookedModule::Body& body, const std::vector<at::Tensor>& inputs,
                      const CheckpointOptions& options);
at::Tensor checkpoint(const HookedModule::Body& body, const std::vector<at::Tensor>& inputs, SaveOps save = SaveOps::None);

// Whether this thread is recomputing a checkpointed body in backward (state a body updates once per
// forward, such as an MoE layer's token counts, must not be updated again then).
bool recomputing();

// Makes `module`'s body checkpointed (its hooks still run once per forward, outside the recomputation).
void apply_activation_checkpointing(HookedModule& module, const CheckpointOptions& options);
void apply_activation_checkpointing(HookedModule& module, SaveOps save = SaveOps::None);

// torchtitan's per_op_sac_force_recompute_mm_shapes_by_fqns: the Linear layers in `module` (itself
// included) whose name, `prefix` + their name inside it (e.g. "layers.3." + "moe.router.gate"),
// contains one of `fqns` are always recomputed under a per-operator policy and do not move its
// every-other count (a float8 one is still kept, as torchtitan keeps every _scaled_mm). torchtitan
// marks every matmul of those layers' shapes; titan marks the layers themselves. A match that is not
// a Linear is a UserError.
void force_recompute_linears(torch::nn::Module& module, const std::string& prefix, const std::vector<std::string>& fqns);

// x Wᵀ (at::linear, or nn::float8_linear under a float8 recipe). Inside a body checkpointed with a
// per-operator policy its output may be kept; a float8 matmul's always is (torchtitan's policy
// keeps every _scaled_mm output and alternates over the plain matmuls only).
at::Tensor saveable_linear(const at::Tensor& x, const at::Tensor& weight, const Float8Recipe* float8 = nullptr,
                           const Float8Sharding* float8_sharding = nullptr, const Float8Weight* float8_weight = nullptr);
// plain(q, k, v) outside per-operator checkpointing. Inside it, the forward runs kernels.forward and
// keeps its output and log-sum-exp; the recomputation hands the kept output out, back-propagated by
// kernels.backward. `kernels` must compute what `plain` does (and outlive the backward).
at::Tensor saveable_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>& plain,
                              const AttentionKernels& kernels);

}  // namespace titan::nn
