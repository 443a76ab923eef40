// Llama 3 <-> Hugging Face transformers (LlamaForCausalLM) state-dict conversion.
//
// Names map one to one (tok_embeddings -> model.embed_tokens, attention.wq -> self_attn.q_proj,
// feed_forward.w1/w3/w2 -> mlp.gate_proj/up_proj/down_proj, ...). wq and wk rows are permuted
// between Meta's interleaved RoPE pairs and HF's rotate-half layout. With tied embeddings HF
// stores no lm_head.weight.
#pragma once

#include "titan/models/llama3/args.h"
#include "titan/models/registry.h"

namespace titan::llama3 {

HFAdapter hf_adapter(const ModelArgs& args);

}  // namespace titan::llama3
