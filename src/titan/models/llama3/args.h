// Llama 3: the shared decoder (models/common/decoder.h) with the flavors torchtitan defines
// (debugmodel, 1B, 3B, 8B, 70B, 405B): grouped KV heads, RoPE theta 500000 with Llama 3.1 scaling,
// norm epsilon 1e-5, the vocabulary of the Llama 3 tokenizer (128256).
#pragma once

#include "titan/models/common/decoder_args.h"

#include <string>

namespace titan::llama3 {

using ModelArgs = DecoderArgs;
using RopeScaling = titan::RopeScaling;

// Flavors by name, in torchtitan's order.
const FlavorTable& flavors();
// The named flavor, or a UserError listing the known ones.
ModelArgs flavor(const std::string& name);

}  // namespace titan::llama3
