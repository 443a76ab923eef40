// Applies parallelisms to a decoder (decoder.h) from outside, in torchtitan's order: tensor parallelism
// (with sequence and loss parallel), activation checkpointing, then data parallelism. The TP plan
// (torchtitan's): tok_embeddings row-wise over the vocabulary; per block attention wq/wk/wv
// column-wise (heads split) and wo row-wise, feed_forward w1/w3 column-wise and w2 row-wise, norms
// replicated (QK-norm weights too: each rank normalizes its own heads, so their gradients are
// always summed over tp); MoE layers replicated (each rank routes the tokens it holds: its part of
// the sequence under sequence parallelism; with expert parallelism their experts are split over ep
// ranks of its own tp index); output column-wise (the vocabulary split). FSDP/HSDP units: each transformer block,
// [norm, output], and the root (token embeddings) last.
#pragma once

#include "titan/models/registry.h"

namespace titan {

ParallelizedModel parallelize_decoder(LanguageModelImpl& model, const ParallelizeContext& ctx);

}  // namespace titan
