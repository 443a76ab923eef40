// The feature gate: options that configs may contain (torchtitan's files do) but whose feature
// titan does not implement yet. Switching one on is an error that names the option and how to
// switch it off; nothing is silently ignored. When a feature lands, delete its row.
#include "titan/common/error.h"
#include "titan/config/field.h"
#include "titan/config/job_config.h"

#include <sstream>

namespace titan {

namespace {

struct Gate {
  const char* key;       // the option that switches the feature on
  const char* feature;
  const char* turn_off;  // command-line spelling that switches it off
  bool (*on)(const JobConfig&, int64_t world_size);
};

// clang-format off
const Gate kGates[] = {
  {"compile.enable", "graph compilation", "--compile.enable false",
   [](const JobConfig& c, int64_t) { return c.compile.enable; }},
  // No C++ client of W&B exists; the same figures go to TensorBoard and to metrics.jsonl, which
  // `titan report` draws.
  {"metrics.enable_wandb", "Weights & Biases logging",
   "--metrics.enable_wandb false; the same metrics go to TensorBoard files (--metrics.enable_tensorboard true, "
   "under <dump_folder>/<save_tb_folder>) and to <dump_folder>/metrics.jsonl, which `titan report DUMP_FOLDER` "
   "draws as one HTML page",
   [](const JobConfig& c, int64_t) { return c.metrics.enable_wandb; }},
  {"fault_tolerance.enable", "fault-tolerant training", "--fault_tolerance.enable false",
   [](const JobConfig& c, int64_t) { return c.fault_tolerance.enable; }},
  {"comm.mode", "fake or local-tensor communication modes", "--comm.mode default",
   [](const JobConfig& c, int64_t) { return c.comm.mode != "default"; }},
  {"job.custom_config_module", "custom config modules", "--job.custom_config_module=",
   [](const JobConfig& c, int64_t) { return !c.job.custom_config_module.empty(); }},
  {"experimental.custom_import", "custom model or component modules", "--experimental.custom_import=",
   [](const JobConfig& c, int64_t) { return !c.experimental.custom_import.empty(); }},
  {"experimental.custom_args_module", "custom config modules", "--experimental.custom_args_module=",
   [](const JobConfig& c, int64_t) { return !c.experimental.custom_args_module.empty(); }},
};
// clang-format on

}  // namespace

void check_supported(const JobConfig& cfg, int64_t world_size) {
  TITAN_ASSERT(world_size >= 1, "world_size must be positive");
  JobConfig copy = cfg;  // for printing values by name
  const auto fields = config::fields_of(copy);
  std::ostringstream problems;
  int count = 0;
  for (const Gate& g : kGates) {
    if (!g.on(cfg, world_size)) continue;
    const std::string key = g.key;
    const config::FieldRef* f = config::find_field(fields, key.substr(0, key.rfind('.')), key.substr(key.rfind('.') + 1));
    TITAN_ASSERT(f, "feature gate names a missing option: ", key);
    problems << "\n  " << key << " = " << config::format_value(f->value);
    problems << " needs " << g.feature << ", not supported yet; turn it off with " << g.turn_off;
    ++count;
  }
  if (count)
    throw UserError(detail::concat("this config switches on ", count == 1 ? "a feature" : "features",
                                   " titan does not support yet (set these in the TOML file or on the command line):",
                                   problems.str()));
}

}  // namespace titan
