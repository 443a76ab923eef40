// The tokenizer files of a Hugging Face export (see export_hf_tokenizer in hf.h).
#include "titan/common/assets.h"
#include "titan/common/error.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/components/tokenizer/tokenizer.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <regex>

namespace titan::checkpoint {
namespace fs = std::filesystem;
namespace {

void write_json(const fs::path& path, const nlohmann::json& j) {
  std::ofstream out(path);
  out << j.dump(2) << "\n";
  TITAN_USER_CHECK(out.good(), "cannot write ", path.string());
}

void copy_into(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  TITAN_USER_CHECK(!ec, "cannot copy ", from.string(), " to ", to.string(), ": ", ec.message());
}

// Whether a .model file is tiktoken's text format ("<base64> <rank>" lines) rather than SentencePiece's
// protobuf.
bool is_tiktoken(const fs::path& file) {
  std::ifstream in(file);
  std::string line;
  std::getline(in, line);
  static const std::regex re(R"(^[A-Za-z0-9+/=]+ \d+\r?$)");
  return std::regex_match(line, re);
}

// The text of special token `id` in a tokenizer.json ("added_tokens"), or "".
std::string added_token(const nlohmann::json& tokenizer_json, int32_t id) {
  if (tokenizer_json.contains("added_tokens"))
    for (const auto& t : tokenizer_json.at("added_tokens"))
      if (t.value("id", -1) == id) return t.value("content", "");
  return "";
}

}  // namespace

std::string export_hf_tokenizer(const std::string& assets_in, const std::string& out_dir) {
  std::error_code ec;
  std::string assets = assets_in;
  if (!assets.empty() && !fs::exists(assets, ec)) assets = find_asset(assets);
  if (assets.empty() || !fs::exists(assets, ec))
    return "no tokenizer exported: model.hf_assets_path '" + assets_in + "' was not found";
  std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(assets);
  const fs::path dir = fs::is_directory(assets, ec) ? fs::path(assets) : fs::path(assets).parent_path();
  const fs::path out(out_dir);
  const auto bos = tokenizer->bos_id(), eos = tokenizer->eos_id();

  nlohmann::json generation = {{"_from_model_config", true}};
  if (bos) generation["bos_token_id"] = *bos;
  if (eos) generation["eos_token_id"] = *eos;
  write_json(out / "generation_config.json", generation);

  // The file load_tokenizer read: tokenizer.json first, as it prefers.
  fs::path json_file = fs::is_directory(assets, ec) ? dir / "tokenizer.json" : fs::path(assets);
  if (fs::is_regular_file(json_file, ec) && json_file.extension() == ".json") {
    copy_into(json_file, out / "tokenizer.json");
    std::string what = "tokenizer.json";
    bool have_config = false;
    for (const char* extra : {"tokenizer_config.json", "special_tokens_map.json"})
      if (fs::is_regular_file(dir / extra, ec)) {
        copy_into(dir / extra, out / extra);
        what += std::string(", ") + extra;
        have_config |= std::string(extra) == "tokenizer_config.json";
      }
    if (!have_config) {
      std::ifstream in(json_file);
      const nlohmann::json tj = nlohmann::json::parse(in);
      nlohmann::json config = {{"tokenizer_class", "PreTrainedTokenizerFast"},
                               {"clean_up_tokenization_spaces", false},
                               {"model_input_names", {"input_ids", "attention_mask"}}};
      if (bos && !added_token(tj, *bos).empty()) config["bos_token"] = added_token(tj, *bos);
      if (eos && !added_token(tj, *eos).empty()) config["eos_token"] = added_token(tj, *eos);
      write_json(out / "tokenizer_config.json", config);
      what += ", tokenizer_config.json (written)";
    }
    return "tokenizer: " + what + " and generation_config.json";
  }
  fs::path model_file = fs::is_directory(assets, ec) ? dir / "tokenizer.model" : fs::path(assets);
  if (fs::is_directory(assets, ec) && !fs::exists(model_file, ec)) model_file = dir / "original" / "tokenizer.model";
  if (!fs::is_regular_file(model_file, ec))
    return "no tokenizer exported: no tokenizer.json or tokenizer.model in " + dir.string();
  if (is_tiktoken(model_file))
    return "no tokenizer exported: " + model_file.string() + " is a tiktoken model, and transformers reads a "
           "tokenizer.json (export one with the tokenizer's own tools, e.g. Meta's Llama 3 conversion script); "
           "generation_config.json written";
  copy_into(model_file, out / "tokenizer.model");
  nlohmann::json config = {{"tokenizer_class", "LlamaTokenizer"},
                           {"add_bos_token", true},
                           {"add_eos_token", false},
                           {"legacy", false},
                           {"clean_up_tokenization_spaces", false}};
  if (bos && !tokenizer->decode({*bos}).empty()) config["bos_token"] = tokenizer->decode({*bos});
  if (eos && !tokenizer->decode({*eos}).empty()) config["eos_token"] = tokenizer->decode({*eos});
  write_json(out / "tokenizer_config.json", config);
  return "tokenizer: tokenizer.model (SentencePiece), tokenizer_config.json and generation_config.json";
}

}  // namespace titan::checkpoint
