// Applies parallelisms to a Llama 3 model from outside, in torchtitan's order: tensor parallelism
// (with sequence and loss parallel), activation checkpointing, then data parallelism. The TP plan
// (torchtitan's): tok_embeddings row-wise over the vocabulary; per block attention wq/wk/wv
// column-wise (heads split) and wo row-wise, feed_forward w1/w3 column-wise and w2 row-wise, norms
// replicated; output column-wise (the vocabulary split). FSDP/HSDP units: each transformer block,
// [norm, output], and the root (token embeddings) last.
#pragma once

#include "titan/models/registry.h"

namespace titan::llama3 {

ParallelizedModel parallelize(LanguageModelImpl& model, const ParallelizeContext& ctx);

}  // namespace titan::llama3
