#include "titan/models/pipeline_split.h"

#include "titan/common/error.h"

namespace titan {

std::vector<std::vector<std::string>> pipeline_split(int64_t num_stages, int64_t num_layers, int64_t input_weight,
                                                     int64_t output_weight) {
  TITAN_USER_CHECK(num_stages >= 1, "the number of pipeline stages must be at least 1, got ", num_stages);
  TITAN_USER_CHECK(input_weight >= 0 && output_weight >= 0, "pipeline stage weights must not be negative");
  auto block = [](int64_t i) { return "layers." + std::to_string(i); };
  if (num_stages == 1) {
    std::vector<std::string> all = {"tok_embeddings"};
    for (int64_t i = 0; i < num_layers; ++i) all.push_back(block(i));
    all.insert(all.end(), {"norm", "output"});
    return {all};
  }
  const int64_t effective = num_layers + input_weight + output_weight;
  TITAN_USER_CHECK(num_stages <= effective, num_stages, " pipeline stages cannot share ", effective,
                   " effective layers (", num_layers, " blocks + embedding weight ", input_weight,
                   " + output weight ", output_weight, "): use fewer stages");
  const int64_t per_stage = effective / num_stages, extra = effective % num_stages;
  TITAN_USER_CHECK(input_weight <= per_stage && output_weight <= per_stage, "with ", num_stages, " stages each holds ",
                   per_stage, " effective layers, fewer than the embedding weight ", input_weight,
                   " or output weight ", output_weight,
                   ": lower pipeline_parallel_first/last_stage_less_layers or use fewer stages");
  std::vector<std::vector<std::string>> stages(num_stages);
  int64_t next = 0;
  for (int64_t s = 0; s < num_stages; ++s) {
    int64_t blocks = per_stage + (s < extra ? 1 : 0);
    if (s == 0) {
      stages[s].push_back("tok_embeddings");
      blocks -= input_weight;
    } else if (s == num_stages - 1) {
      blocks -= output_weight;
    }
    for (int64_t b = 0; b < blocks && next < num_layers; ++b) stages[s].push_back(block(next++));
    if (s == num_stages - 1) stages[s].insert(stages[s].end(), {"norm", "output"});
  }
  TITAN_ASSERT(next == num_layers, "pipeline split placed ", next, " of ", num_layers, " blocks");
  return stages;
}

}  // namespace titan
