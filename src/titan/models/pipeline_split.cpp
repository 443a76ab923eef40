#include "titan/models/pipeline_split.h"

#include "titan/common/error.h"
#include "titan/common/listing.h"
#include "titan/models/registry.h"

#include <algorithm>
#include <cctype>

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

namespace {
bool multi_stage_schedule(std::string name) {
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name == "interleaved1f1b" || name == "loopedbfs" || name == "interleavedzerobubble" ||
         name == "zbvzerobubble" || name == "dualpipev";
}
}  // namespace

std::vector<std::vector<std::string>> split_at_points(const std::vector<std::string>& all,
                                                      const std::vector<std::string>& points) {
  std::vector<std::vector<std::string>> stages(1);
  size_t next = 0;  // the next split point expected
  for (size_t i = 0; i < all.size(); ++i) {
    if (next < points.size() && all[i] == points[next]) {
      TITAN_USER_CHECK(i > 0, "parallelism.pipeline_parallel_split_points: '", points[next],
                       "' is the model's first module, so the first stage would be empty");
      stages.emplace_back();
      ++next;
    }
    stages.back().push_back(all[i]);
  }
  if (next < points.size()) {
    const bool known = std::find(all.begin(), all.end(), points[next]) != all.end();
    throw UserError("parallelism.pipeline_parallel_split_points: '" + points[next] + "' " +
                    (known ? "is out of order (split points go in the model's order, each once)"
                           : "is not a module of the model; the modules are " + joined(all)));
  }
  return stages;
}

void check_stage_modules(const std::vector<std::vector<std::string>>& stages, const std::vector<std::string>& all) {
  const std::string key = "parallelism.module_fqns_per_model_part";
  size_t next = 0;
  for (size_t s = 0; s < stages.size(); ++s) {
    TITAN_USER_CHECK(!stages[s].empty(), key, ": stage ", s, " holds no modules");
    for (const auto& name : stages[s]) {
      const auto it = std::find(all.begin(), all.end(), name);
      TITAN_USER_CHECK(it != all.end(), key, ": '", name, "' (stage ", s, ") is not a module of the model; the modules are ",
                       joined(all));
      TITAN_USER_CHECK(static_cast<size_t>(it - all.begin()) == next, key, ": '", name, "' (stage ", s, ") is ",
                       static_cast<size_t>(it - all.begin()) < next ? "listed twice or out of order"
                                                                   : "not next in the model's order: '" + all[next] +
                                                                         "' comes first",
                       "; stages must hold the modules ", joined(all), " in this order, each once");
      ++next;
    }
  }
  TITAN_USER_CHECK(next == all.size(), key, ": '", next < all.size() ? all[next] : "", "' and the modules after it are in no stage");
}

PipelinePlan plan_pipeline(const ModelSpec& spec, const std::string& flavor, const config::Parallelism& par,
                           int64_t local_batch_size) {
  const int pp = static_cast<int>(par.pipeline_parallel_degree);
  TITAN_USER_CHECK(spec.pipeline_split && spec.build_stage, "model ", spec.name,
                   " cannot be split into pipeline stages (its spec has no pipeline_split): use "
                   "parallelism.pipeline_parallel_degree 1");
  PipelinePlan plan;
  const int64_t mbs = par.pipeline_parallel_microbatch_size;
  TITAN_USER_CHECK(local_batch_size % mbs == 0, "training.local_batch_size ", local_batch_size,
                   " is not a multiple of parallelism.pipeline_parallel_microbatch_size ", mbs,
                   ": the pipeline runs local_batch_size / microbatch_size microbatches per batch");
  plan.microbatch_size = mbs;
  plan.microbatches = static_cast<int>(local_batch_size / mbs);

  // ---- the stages' modules
  const std::vector<std::string> all = spec.pipeline_split(flavor, 1, 0, 0).at(0);
  const int64_t n_layers = std::count_if(all.begin(), all.end(), [](const std::string& m) { return m.rfind("layers.", 0) == 0; });
  const bool csv = !par.pipeline_parallel_schedule_csv.empty();
  plan.schedule = csv ? par.pipeline_parallel_schedule_csv : par.pipeline_parallel_schedule;
  int csv_stages = 0;
  if (csv) {
    plan.order = dist::read_schedule_csv(par.pipeline_parallel_schedule_csv);
    for (const auto& row : plan.order)
      for (const auto& a : row)
        if (a) csv_stages = std::max(csv_stages, a->stage + 1);
    TITAN_USER_CHECK(static_cast<int>(plan.order.size()) == pp, "parallelism.pipeline_parallel_schedule_csv ",
                     par.pipeline_parallel_schedule_csv, " has ", plan.order.size(), " rows, one per pipeline rank, but "
                     "pipeline_parallel_degree is ", pp);
  }
  if (!par.module_fqns_per_model_part.empty()) {
    plan.stage_modules = par.module_fqns_per_model_part;
  } else if (!par.pipeline_parallel_split_points.empty()) {
    plan.stage_modules = split_at_points(all, par.pipeline_parallel_split_points);
  } else {
    int64_t num_stages = pp * (multi_stage_schedule(par.pipeline_parallel_schedule) ? 2 : 1);
    if (par.pipeline_parallel_layers_per_stage) {
      const int64_t effective =
          n_layers + par.pipeline_parallel_first_stage_less_layers + par.pipeline_parallel_last_stage_less_layers;
      num_stages = (effective + *par.pipeline_parallel_layers_per_stage - 1) / *par.pipeline_parallel_layers_per_stage;
    } else if (csv) {
      num_stages = csv_stages;
    }
    plan.stage_modules = spec.pipeline_split(flavor, num_stages, par.pipeline_parallel_first_stage_less_layers,
                                             par.pipeline_parallel_last_stage_less_layers);
  }
  check_stage_modules(plan.stage_modules, all);
  const int num_stages = static_cast<int>(plan.stage_modules.size());
  TITAN_USER_CHECK(num_stages >= pp, "the model is split into ", num_stages, " pipeline stage(s), fewer than "
                   "pipeline_parallel_degree ", pp, ": every pipeline rank needs a stage; lower "
                   "pipeline_parallel_layers_per_stage, or give more split points or module_fqns_per_model_part parts");
  TITAN_USER_CHECK(num_stages % pp == 0, "the model is split into ", num_stages,
                   " pipeline stages, which do not divide evenly over pipeline_parallel_degree ", pp,
                   " ranks: choose the split (pipeline_parallel_layers_per_stage, split points or "
                   "module_fqns_per_model_part) so that every rank holds the same number of stages");
  const int per_rank = num_stages / pp;
  if (csv) {
    TITAN_USER_CHECK(csv_stages == num_stages, "parallelism.pipeline_parallel_schedule_csv ",
                     par.pipeline_parallel_schedule_csv, " schedules ", csv_stages, " stages but the model is split into ",
                     num_stages);
  } else {
    plan.order = dist::schedule_by_name(par.pipeline_parallel_schedule, pp, per_rank, plan.microbatches);
  }
  try {
    dist::check_schedule(plan.order, num_stages, plan.microbatches);
  } catch (const UserError& e) {
    throw UserError(std::string(e.what()) + " (" + (csv ? "parallelism.pipeline_parallel_schedule_csv " +
                    par.pipeline_parallel_schedule_csv : "schedule " + par.pipeline_parallel_schedule) + " with " +
                    std::to_string(plan.microbatches) + " microbatches of " + std::to_string(mbs) + ")");
  }
  plan.stage_ranks = dist::stage_ranks(plan.order, num_stages);
  // A tied embedding table is held by the first stage and, as a copy, by the last (their gradients
  // are exchanged between their ranks): they must be on different pipeline ranks.
  if (num_stages > 1 && plan.stage_ranks.front() == plan.stage_ranks.back()) {
    const LanguageModel last = spec.build_stage(flavor, at::TensorOptions().device(at::kMeta), 1, plan.stage_modules.back());
    TITAN_USER_CHECK(last->shared_parameters().empty(), "the first and the last pipeline stage are on the same pipeline "
                     "rank (", csv ? "parallelism.pipeline_parallel_schedule_csv " + par.pipeline_parallel_schedule_csv
                                   : "schedule " + par.pipeline_parallel_schedule,
                     "), and this model ties its output projection to the token embedding, which both stages hold: "
                     "choose a schedule that places them on different ranks (e.g. 1F1B or Interleaved1F1B), or a "
                     "flavor without tied embeddings");
  }
  return plan;
}

}  // namespace titan
