#include "titan/models/registry.h"

#include "titan/common/error.h"
#include "titan/models/llama3/hf_adapter.h"
#include "titan/models/llama3/model.h"
#include "titan/models/llama3/parallelize.h"
#include "titan/models/pipeline_split.h"

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

// The models shipped with titan. Adding one: write its spec function and list it here.
void register_builtin_models_locked() {
  static bool done = false;
  if (done) return;
  done = true;
  ModelSpec llama;
  llama.name = "llama3";
  for (const auto& [name, args] : llama3::flavors()) llama.flavors.push_back(name);
  llama.build = [](const std::string& flavor, const at::TensorOptions& opts, int64_t max_seq_len) -> LanguageModel {
    llama3::ModelArgs args = llama3::flavor(flavor);
    args.max_seq_len = max_seq_len;
    return std::make_shared<llama3::TransformerImpl>(args, opts);
  };
  llama.build_stage = [](const std::string& flavor, const at::TensorOptions& opts, int64_t max_seq_len,
                         const std::vector<std::string>& modules) -> LanguageModel {
    llama3::ModelArgs args = llama3::flavor(flavor);
    args.max_seq_len = max_seq_len;
    TITAN_USER_CHECK(!modules.empty(), "a pipeline stage of llama3 ", flavor, " holds no modules");
    return std::make_shared<llama3::TransformerImpl>(args, opts, modules);
  };
  llama.parallelize = llama3::parallelize;
  llama.pipeline_split = [](const std::string& flavor, int64_t stages, int64_t input_weight, int64_t output_weight) {
    return pipeline_split(stages, llama3::flavor(flavor).n_layers, input_weight, output_weight);
  };
  llama.hf_adapter = [](const std::string& flavor) { return llama3::hf_adapter(llama3::flavor(flavor)); };
  table().emplace(llama.name, std::move(llama));
}

}  // namespace

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
