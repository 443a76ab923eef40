// Llama 2 on the shared decoder (models/common/decoder.h): Meta's released sizes 7B, 13B and 70B
// (34B was never released) and a debug model. RoPE theta 10000 without scaling, norm epsilon 1e-5,
// the 32,000-token SentencePiece vocabulary, untied embeddings, grouped KV heads at 70B only; the
// feed-forward sizes follow the Llama rule (11008, 13824, 28672). Hugging Face: LlamaForCausalLM.
#pragma once

#include "titan/models/common/decoder_args.h"
#include "titan/models/registry.h"

#include <string>

namespace titan::llama2 {

const FlavorTable& flavors();
DecoderArgs flavor(const std::string& name);
ModelSpec spec();

}  // namespace titan::llama2
