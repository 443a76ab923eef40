// Llama 3 is the shared decoder (models/common/decoder.h) with Llama 3's flavors (args.h); these
// names keep the family's own vocabulary.
#pragma once

#include "titan/models/common/decoder.h"
#include "titan/models/llama3/args.h"

namespace titan::llama3 {

using TransformerBlockImpl = DecoderBlockImpl;
using TransformerBlock = DecoderBlock;
using TransformerImpl = DecoderImpl;
using Transformer = Decoder;

}  // namespace titan::llama3
