// The small Llama 3 shape the unit tests share: dim 64, 4 heads over 2 KV heads (grouped-query
// attention), SwiGLU hidden 192, no ffn multiplier. Layers, vocabulary and maximum sequence length
// vary by test (a vocabulary that does not divide by the rank count exercises FSDP's padding).
#pragma once

#include "titan/models/llama3/args.h"

namespace titan::test {

inline llama3::ModelArgs tiny_llama(int64_t n_layers, int64_t vocab_size, int64_t max_seq_len) {
  llama3::ModelArgs a;
  a.dim = 64;
  a.n_layers = n_layers;
  a.n_heads = 4;
  a.n_kv_heads = 2;
  a.vocab_size = vocab_size;
  a.multiple_of = 32;
  a.ffn_dim_multiplier.reset();
  a.max_seq_len = max_seq_len;
  return a;
}

}  // namespace titan::test
