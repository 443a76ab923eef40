// Assigning options to a JobConfig, from one source at a time (the TOML file, then the command
// line), with older spellings translated and unknown keys explained.
#pragma once

#include "titan/config/field.h"
#include "titan/config/legacy.h"

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace titan::config {

// Writes one source's value into a field (the real one, or a temporary for translated keys).
using Store = std::function<void(const FieldRef&)>;

// One source of settings applied to `cfg`. It remembers which spelling set each option, so that
// an older and a newer spelling of the same option with different values in the same source is
// an error rather than a silent winner. (Across sources, the later one simply wins.)
class Layer {
 public:
  explicit Layer(JobConfig& cfg);

  // Sets section.key through `store`; `where` says where it was given (file:line:col or the
  // argument). Returns false when no such key exists (canonical or older spelling).
  bool assign(const std::string& section, const std::string& key, const std::string& where, const Store& store);

  // Whether section.key takes a boolean (so a bare command-line flag means true).
  bool takes_bool(const std::string& section, const std::string& key) const;

 private:
  struct Assignment {
    std::string spelling;  // "section.key" as written
    std::string where;
    std::string value;     // the option's value right after this assignment, as TOML text
  };
  void record(const std::string& option, const std::string& spelling, const std::string& where);
  void assign_legacy(const LegacyKey& legacy, const std::string& where, const Store& store);
  const FieldRef& field(const std::string& path) const;

  JobConfig& cfg_;
  std::vector<FieldRef> fields_;
  std::map<std::string, Assignment> seen_;
};

// Whether `name` is a table a config may contain: a section, an older table ([float8]) or a
// prefix of a nested one ("quantize", "quantize.linear").
bool is_table_name(const std::string& name);
bool is_section_name(const std::string& name);

// "unknown option ..." text for section.key: the nearest valid key, the newer name of an older key
// typed in the wrong table, or the table the key belongs to. `style` "toml" writes
// "[section] key", "cli" writes "--section.key".
std::string suggestion(const std::string& section, const std::string& key, const std::string& style);

}  // namespace titan::config
