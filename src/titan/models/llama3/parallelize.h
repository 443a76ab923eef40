// Applies parallelisms to a Llama 3 model from outside, in torchtitan's order (TP, CP, activation
// checkpointing, FSDP). FSDP/HSDP units: each transformer block, [norm, output], and the root
// (token embeddings) last.
#pragma once

#include "titan/models/registry.h"

namespace titan::llama3 {

void parallelize(LanguageModelImpl& model, const ParallelizeContext& ctx);

}  // namespace titan::llama3
