// Applies parallelisms to a Llama 3 model from outside, in torchtitan's order (TP, CP, activation
// checkpointing, FSDP). Today: FSDP/HSDP with each transformer block a unit and the root (token
// embeddings, final norm, output) the last.
#pragma once

#include "titan/models/registry.h"

namespace titan::llama3 {

void parallelize(LanguageModelImpl& model, const ParallelizeContext& ctx);

}  // namespace titan::llama3
