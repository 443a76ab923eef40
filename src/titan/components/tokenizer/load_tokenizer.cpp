// load_tokenizer: picks the implementation from the path (see tokenizer.h).
#include "titan/common/assets.h"
#include "titan/common/error.h"
#include "titan/components/tokenizer/backends.h"
#include "titan/components/tokenizer/tokenizer.h"

#include <filesystem>
#include <fstream>

namespace titan {

namespace {

namespace fs = std::filesystem;

constexpr const char* kHint =
    " Point model.hf_assets_path (or model.tokenizer_path) at a folder holding tokenizer.json, tokenizer.model "
    "or original/tokenizer.model, or at one of those files. A model's tokenizer on the Hugging Face Hub: "
    ".venv/bin/python scripts/download_hf_assets.py --repo_id ORG/NAME (into assets/hf/NAME).";

// First non-whitespace byte of the file, or 0.
char first_char(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char c = 0;
  while (in.get(c)) {
    if (!std::isspace(static_cast<unsigned char>(c))) return c;
  }
  return 0;
}

std::unique_ptr<Tokenizer> load_file(const std::string& path) {
  if (fs::path(path).extension() == ".json" || first_char(path) == '{') return tokenizer::load_hf_tokenizer(path);
  if (tokenizer::looks_like_tiktoken(path)) return tokenizer::load_tiktoken_tokenizer(path);
  try {
    return tokenizer::load_sentencepiece_tokenizer(path);
  } catch (const UserError&) {
    throw UserError(detail::concat("tokenizer file ", path,
                                   " is neither a tokenizer.json, a tiktoken model (lines of '<base64> <rank>') "
                                   "nor a SentencePiece model.",
                                   kHint));
  }
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& given) {
  std::error_code ec;
  TITAN_USER_CHECK(!given.empty(), "no tokenizer path given.", kHint);
  // A relative path such as the default ./assets/tokenizer is also found beside the titan binary.
  const std::string found = fs::path(given).is_relative() ? find_asset(given) : std::string();
  const std::string path = found.empty() ? given : found;
  TITAN_USER_CHECK(fs::exists(path, ec), "tokenizer path ", path, " does not exist.", kHint);
  if (!fs::is_directory(path, ec)) return load_file(path);
  for (const char* name : {"tokenizer.json", "tokenizer.model", "original/tokenizer.model"}) {
    const fs::path candidate = fs::path(path) / name;
    if (fs::is_regular_file(candidate, ec)) return load_file(candidate.string());
  }
  throw UserError(detail::concat("tokenizer folder ", path,
                                 " holds none of tokenizer.json, tokenizer.model, original/tokenizer.model.", kHint));
}

}  // namespace titan
