// The model configuration tests/reference/llama3_reference.py reads (safetensors metadata "config").
#pragma once

#include "titan/models/llama3/args.h"

#include <nlohmann/json.hpp>

namespace titan::test {

inline nlohmann::json llama3_reference_config(const llama3::ModelArgs& a) {
  nlohmann::json cfg = {{"dim", a.dim},           {"n_layers", a.n_layers},     {"n_heads", a.n_heads},
                        {"n_kv_heads", a.kv_heads()}, {"norm_eps", a.norm_eps}, {"rope_theta", a.rope_theta},
                        {"tie_embeddings", a.tie_embeddings}, {"vocab_size", a.vocab_size}};
  if (a.rope_scaling) {
    const auto& s = *a.rope_scaling;
    cfg["rope_scaling"] = {{"factor", s.factor}, {"low_freq_factor", s.low_freq_factor},
                           {"high_freq_factor", s.high_freq_factor},
                           {"original_max_position_embeddings", s.original_max_position_embeddings}};
  }
  return cfg;
}

}  // namespace titan::test
