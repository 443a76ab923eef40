// A dense model family on the shared decoder: a flavor table and a Hugging Face dialect make its
// whole ModelSpec (build, pipeline stages, parallelize, HF adapter). Adding such a family is a folder
// models/<name>/ with its flavors and one registry entry (docs/models.md).
//
// A flavor is one of the table's names, or a Hugging Face model's own arguments: the path of its
// config.json (or of the folder holding it), or the config's JSON text itself (how checkpoints
// record such a flavor, so that they do not depend on the file).
#pragma once

#include "titan/models/common/decoder_args.h"
#include "titan/models/common/decoder_hf.h"
#include "titan/models/registry.h"

#include <string>

namespace titan {

struct DecoderFamily {
  std::string name;                  // model.name, e.g. "qwen3"
  const FlavorTable* flavors = nullptr;
  HFDialect hf;
};

// The named flavor of `table`, or a UserError listing the known ones.
DecoderArgs table_flavor(const std::string& family, const FlavorTable& table, const std::string& name);
// The arguments of `flavor` (a name, a config.json path, or a config.json text) for `family`.
DecoderArgs decoder_flavor(const DecoderFamily& family, const std::string& flavor);
// Whether `flavor` names a Hugging Face config (JSON text, or a path: with a '/', ending in .json,
// or an existing file or folder) rather than an entry of the family's table (names win).
bool is_hf_config_flavor(const DecoderFamily& family, const std::string& flavor);

ModelSpec decoder_model_spec(const DecoderFamily& family);

}  // namespace titan
