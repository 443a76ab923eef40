// How a decoder-only model is cut into pipeline stages: the module names each stage holds.
//
// The token embedding counts as `input_weight` layers and the final norm + output projection as
// `output_weight` layers (torchtitan's pipeline_parallel_first/last_stage_less_layers); the
// num_layers + input_weight + output_weight effective layers are spread as evenly as possible, the
// first stages taking one more when they do not divide. Stage 0 starts with "tok_embeddings", the
// last stage ends with "norm", "output"; blocks are "layers.N".
#pragma once

#include "titan/config/sections_run.h"
#include "titan/distributed/pipeline_schedule.h"

#include <cstdint>
#include <string>
#include <vector>

namespace titan {

struct ModelSpec;

// Throws UserError when the stages cannot all hold something (more stages than effective layers,
// or a weight larger than a stage's share).
std::vector<std::vector<std::string>> pipeline_split(int64_t num_stages, int64_t num_layers, int64_t input_weight = 1,
                                                     int64_t output_weight = 1);

// The stages cut from `all` (a model's modules in forward order) where each split point starts a
// new stage (torchtitan's pipeline_parallel_split_points, e.g. {"layers.4", "layers.8"}: three
// stages). Throws UserError for a point that is not a module of `all`, out of order, or the first.
std::vector<std::vector<std::string>> split_at_points(const std::vector<std::string>& all,
                                                      const std::vector<std::string>& points);

// Checks that `stages` hold every module of `all` exactly once, in forward order (stage k's modules
// before stage k+1's), and that no stage is empty. Throws UserError naming the first problem.
void check_stage_modules(const std::vector<std::vector<std::string>>& stages, const std::vector<std::string>& all);

// A run's pipeline as parallelism.* configures it: the modules of every stage and the schedule of
// every pipeline rank (the trainer builds this rank's stages from it; `titan estimate` every rank's).
//
// Stages: module_fqns_per_model_part when given, else cut at pipeline_parallel_split_points, else
// the model's own split (ModelSpec::pipeline_split) into ceil((layers + first_stage_less_layers +
// last_stage_less_layers) / layers_per_stage) stages, or pp x (1, or 2 for the multi-stage
// schedules) without layers_per_stage, or the CSV schedule's stages.
struct PipelinePlan {
  std::vector<std::vector<std::string>> stage_modules;  // per stage, in forward order
  dist::PipelineOrder order;                             // per pipeline rank: its actions (checked)
  std::vector<int> stage_ranks;                          // stage -> pipeline rank
  int microbatches = 1;                                  // per local batch
  int64_t microbatch_size = 1;                           // sequences per microbatch
  std::string schedule;                                  // the schedule's name, or its CSV file
};

// Throws UserError for a split or schedule the run cannot use, naming the option to change.
PipelinePlan plan_pipeline(const ModelSpec& spec, const std::string& flavor, const config::Parallelism& par,
                           int64_t local_batch_size);

}  // namespace titan
