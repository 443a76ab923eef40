// Activation checkpointing: a module's body runs in forward without recording a graph (only its
// inputs are kept), and runs again in backward, with the graph, to back-propagate through it (like
// torch.utils.checkpoint with use_reentrant=True). Gradients are those of the plain body: the
// recomputation repeats the same operations on the same values (no randomness in the bodies it wraps).
// Autocast is restored for the recomputation as it was in forward.
#pragma once

#include "titan/models/common/hooks.h"

namespace titan::nn {

// Runs `body(inputs)` checkpointed: see above. Without grad mode it simply runs the body.
at::Tensor checkpoint(const HookedModule::Body& body, const std::vector<at::Tensor>& inputs);

// Makes `module`'s body checkpointed (its hooks still run once per forward, outside the recomputation).
void apply_activation_checkpointing(HookedModule& module);

}  // namespace titan::nn
