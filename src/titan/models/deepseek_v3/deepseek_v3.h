// DeepSeek-V3 on the shared decoder (models/common/decoder.h), with torchtitan's flavors debugmodel,
// 16B, 236B and 671B: multi-head latent attention (nn/mla.h) with YaRN-scaled RoPE over its rotary
// dims, the first n_dense_layers dense and the rest mixtures of experts with shared experts (softmax
// routing for the smaller flavors, sigmoid group-limited routing for 671B). Hugging Face:
// DeepseekV3ForCausalLM.
#pragma once

#include "titan/models/common/decoder_args.h"
#include "titan/models/registry.h"

#include <string>

namespace titan::deepseek_v3 {

const FlavorTable& flavors();
DecoderArgs flavor(const std::string& name);
ModelSpec spec();

}  // namespace titan::deepseek_v3
