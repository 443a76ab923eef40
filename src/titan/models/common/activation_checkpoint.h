// Activation checkpointing: a module's body runs in forward without recording a graph (only its
// inputs are kept), and runs again in backward, with the graph, to back-propagate through it (like
// torch.utils.checkpoint with use_reentrant=True). Gradients are those of the plain body: the
// recomputation repeats the same operations on the same values (no randomness in the bodies it wraps).
// Autocast (CUDA and CPU) is restored for the recomputation as it was in forward.
//
// Per-operator policy (save_ops, torchtitan's selective_ac_option "op"): the body's expensive
// operations — every matmul that goes through nn::saveable_linear (all Linear layers) and every
// operation wrapped in nn::saveable_op (attention) — keep their outputs from the forward; the
// recomputation in backward runs only the cheap operations between them (norms, RoPE, the SwiGLU
// product, residual adds, views) and takes the kept outputs instead of running those operations
// again. A kept matmul back-propagates with its own formulas (grad_x = g W, grad_W = gᵀ x); a kept
// attention back-propagates through the fused kernel, which runs its forward once more inside its
// backward (its log-sum-exp is not kept).
#pragma once

#include "titan/models/common/hooks.h"

namespace titan::nn {

// Runs `body(inputs)` checkpointed: see above. Without grad mode it simply runs the body.
// save_ops: the per-operator policy.
at::Tensor checkpoint(const HookedModule::Body& body, const std::vector<at::Tensor>& inputs, bool save_ops = false);

// Makes `module`'s body checkpointed (its hooks still run once per forward, outside the recomputation).
void apply_activation_checkpointing(HookedModule& module, bool save_ops = false);

// x Wᵀ (at::linear). Inside a body checkpointed with the per-operator policy its output is kept.
at::Tensor saveable_linear(const at::Tensor& x, const at::Tensor& weight);
// op(inputs). Inside a body checkpointed with the per-operator policy its output is kept, and its
// backward runs op again with a graph (for operations whose backward needs their forward's internals).
at::Tensor saveable_op(const std::vector<at::Tensor>& inputs, const HookedModule::Body& op);

}  // namespace titan::nn
