// Qwen3 (dense) on the shared decoder (models/common/decoder.h), with torchtitan's flavors: the
// released 0.6B, 1.7B, 4B, 8B, 14B and 32B and a debug model. Every flavor has heads of 128
// (not dim / n_heads), QK-norm, RoPE theta 1e6 without scaling, norm epsilon 1e-6 and the
// 151,936-token vocabulary; 0.6B, 1.7B and 4B (and the debug model) tie the output projection to
// the embedding. Hugging Face: Qwen3ForCausalLM.
#pragma once

#include "titan/models/common/decoder_args.h"
#include "titan/models/registry.h"

#include <string>

namespace titan::qwen3 {

const FlavorTable& flavors();
DecoderArgs flavor(const std::string& name);
ModelSpec spec();

}  // namespace titan::qwen3
