#include "titan/models/common/decoder_spec.h"

#include "titan/common/error.h"
#include "titan/models/common/decoder.h"
#include "titan/models/common/decoder_parallelize.h"
#include "titan/models/pipeline_split.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace titan {

namespace fs = std::filesystem;

DecoderArgs table_flavor(const std::string& family, const FlavorTable& table, const std::string& name) {
  std::string known;
  for (const auto& [n, args] : table) {
    if (n == name) return args;
    known += (known.empty() ? "" : ", ") + n;
  }
  throw UserError("model.flavor '" + name + "' is not a " + family + " flavor; choose one of: " + known +
                  ", or give the path of a Hugging Face config.json");
}

bool is_hf_config_flavor(const DecoderFamily& family, const std::string& flavor) {
  for (const auto& [name, args] : *family.flavors)
    if (name == flavor) return false;
  std::error_code ec;
  return !flavor.empty() && (flavor.front() == '{' || flavor.find('/') != std::string::npos ||
                             (flavor.size() > 5 && flavor.compare(flavor.size() - 5, 5, ".json") == 0) ||
                             fs::exists(flavor, ec));
}

DecoderArgs decoder_flavor(const DecoderFamily& family, const std::string& flavor) {
  if (!is_hf_config_flavor(family, flavor)) return table_flavor(family.name, *family.flavors, flavor);
  std::string text = flavor, where = "the recorded Hugging Face config";
  if (flavor.front() != '{') {
    fs::path path = flavor;
    if (fs::is_directory(path)) path /= "config.json";
    std::ifstream in(path);
    TITAN_USER_CHECK(in && fs::is_regular_file(path), "model.flavor '", flavor, "': no such file. A flavor is a ",
                     family.name, " flavor name or the path of a Hugging Face config.json (or of its folder)");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
    where = path.string();
  }
  try {
    return decoder_args_from_hf_config(text, family.hf);
  } catch (const UserError& e) {
    throw UserError("model.flavor: " + where + " does not describe a " + family.name + " model titan can train: " +
                    e.what());
  }
}

ModelSpec decoder_model_spec(const DecoderFamily& family) {
  ModelSpec spec;
  spec.name = family.name;
  for (const auto& [name, args] : *family.flavors) spec.flavors.push_back(name);
  spec.build = [family](const std::string& flavor, const at::TensorOptions& opts, int64_t max_seq_len) -> LanguageModel {
    DecoderArgs args = decoder_flavor(family, flavor);
    args.max_seq_len = max_seq_len;
    return std::make_shared<DecoderImpl>(args, opts);
  };
  spec.build_stage = [family](const std::string& flavor, const at::TensorOptions& opts, int64_t max_seq_len,
                              const std::vector<std::string>& modules) -> LanguageModel {
    DecoderArgs args = decoder_flavor(family, flavor);
    args.max_seq_len = max_seq_len;
    TITAN_USER_CHECK(!modules.empty(), "a pipeline stage of ", family.name, " ", flavor, " holds no modules");
    return std::make_shared<DecoderImpl>(args, opts, modules);
  };
  spec.parallelize = parallelize_decoder;
  spec.pipeline_split = [family](const std::string& flavor, int64_t stages, int64_t input_weight, int64_t output_weight) {
    return pipeline_split(stages, decoder_flavor(family, flavor).n_layers, input_weight, output_weight);
  };
  spec.hf_adapter = [family](const std::string& flavor) {
    return decoder_hf_adapter(decoder_flavor(family, flavor), family.hf);
  };
  spec.flavor_record = [family](const std::string& flavor) -> std::string {
    if (!is_hf_config_flavor(family, flavor)) return flavor;
    // The arguments themselves, as a compact config.json, independent of the file.
    const std::string text = decoder_hf_adapter(decoder_flavor(family, flavor), family.hf).config_json(at::kFloat);
    return nlohmann::json::parse(text).dump();
  };
  return spec;
}

}  // namespace titan
