// How a decoder-only model is cut into pipeline stages: the module names each stage holds.
//
// The token embedding counts as `input_weight` layers and the final norm + output projection as
// `output_weight` layers (torchtitan's pipeline_parallel_first/last_stage_less_layers); the
// num_layers + input_weight + output_weight effective layers are spread as evenly as possible, the
// first stages taking one more when they do not divide. Stage 0 starts with "tok_embeddings", the
// last stage ends with "norm", "output"; blocks are "layers.N".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace titan {

// Throws UserError when the stages cannot all hold something (more stages than effective layers,
// or a weight larger than a stage's share).
std::vector<std::vector<std::string>> pipeline_split(int64_t num_stages, int64_t num_layers, int64_t input_weight = 1,
                                                     int64_t output_weight = 1);

}  // namespace titan
