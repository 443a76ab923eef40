// The llama3 entry of the model registry.
#pragma once

#include "titan/models/common/decoder_args.h"
#include "titan/models/registry.h"

namespace titan::llama3 {

ModelSpec spec();
// LlamaForCausalLM <-> a Llama 3 shaped decoder of `args`.
HFAdapter hf_adapter(const DecoderArgs& args);

}  // namespace titan::llama3
