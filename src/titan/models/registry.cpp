#include "titan/models/registry.h"

#include "titan/common/error.h"
#include "titan/models/llama2/llama2.h"
#include "titan/models/llama3/llama3.h"
#include "titan/models/deepseek_v3/deepseek_v3.h"
#include "titan/models/qwen3/qwen3.h"

#include <mutex>

namespace titan {
namespace {

std::map<std::string, ModelSpec>& table() {
  static std::map<std::string, ModelSpec> specs;
  return specs;
}

std::mutex& table_mutex() {
  static std::mutex m;
  return m;
}

// The models shipped with titan. Adding one: its folder under models/ and one line here.
void register_builtin_models_locked() {
  static bool done = false;
  if (done) return;
  done = true;
  for (ModelSpec spec : {llama3::spec(), llama2::spec(), qwen3::spec(), deepseek_v3::spec()}) table().emplace(spec.name, std::move(spec));
}

}  // namespace

void set_activation_checkpointing(ParallelizeContext& ctx, const config::ActivationCheckpoint& ac) {
  ctx.ac_mode = ac.mode;
  ctx.ac_check_recompute = ac.determinism_check != "none";
  ctx.ac_force_recompute = ac.per_op_sac_force_recompute_mm_shapes_by_fqns;  // used by per-operator blocks only
  if (ctx.ac_mode != "selective") return;
  if (ac.selective_ac_option == "op") {
    ctx.ac_mode = ac.per_op_policy == "all_matmuls" ? "op_all_matmuls" : "op";
    return;
  }
  int64_t k = 0;
  try {
    k = std::stoll(ac.selective_ac_option);
  } catch (const std::exception&) {
  }
  TITAN_USER_CHECK(k >= 1, "activation_checkpoint.selective_ac_option '", ac.selective_ac_option,
                   "' is neither a positive integer (every k-th block) nor 'op'");
  ctx.ac_every = k;
}

void register_model(ModelSpec spec) {
  std::lock_guard<std::mutex> lock(table_mutex());
  register_builtin_models_locked();
  TITAN_ASSERT(!table().count(spec.name), "model '", spec.name, "' registered twice");
  table().emplace(spec.name, std::move(spec));
}

const ModelSpec& model_spec(const std::string& name) {
  std::lock_guard<std::mutex> lock(table_mutex());
  register_builtin_models_locked();
  auto it = table().find(name);
  if (it != table().end()) return it->second;
  std::string known;
  for (const auto& [n, spec] : table()) known += (known.empty() ? "" : ", ") + n;
  throw UserError("model.name '" + name + "' is not a registered model; choose one of: " + known);
}

std::vector<std::string> registered_models() {
  std::lock_guard<std::mutex> lock(table_mutex());
  register_builtin_models_locked();
  std::vector<std::string> names;
  for (const auto& [n, spec] : table()) names.push_back(n);
  return names;
}

}  // namespace titan
