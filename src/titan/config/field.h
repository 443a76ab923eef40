// The flat view of a JobConfig that parsing, --help and the dump share: one FieldRef per key,
// collected by running the sections' visit() lists over a config instance, plus the typed
// conversions between a field's value and TOML nodes / command-line strings.
#pragma once

#include "titan/config/job_config.h"

#include <toml++/toml.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace titan::config {

// A pointer to the field's storage inside one JobConfig.
using ValuePtr = std::variant<bool*, int64_t*, double*, std::string*, std::vector<std::string>*,
                              std::vector<int64_t>*, std::vector<std::vector<std::string>>*, std::optional<int64_t>*,
                              std::optional<double>*>;

struct FieldRef {
  std::string section;                // TOML table, e.g. "training" or "quantize.linear.float8"
  std::string key;                    // e.g. "local_batch_size"
  std::string help;
  std::vector<std::string> choices;   // allowed values of a string field; empty: any
  ValuePtr value;
  std::string path() const { return section + "." + key; }
};

struct SectionInfo {
  std::string name;
  std::string help;
};

// All fields of `cfg`, in declaration order; the pointers refer into `cfg`.
std::vector<FieldRef> fields_of(JobConfig& cfg);
// The tables, in declaration order.
const std::vector<SectionInfo>& sections();
// The field named section.key in `fields`, or nullptr.
const FieldRef* find_field(const std::vector<FieldRef>& fields, std::string_view section, std::string_view key);

// Human name of a field's type, e.g. "integer", "list of strings".
std::string type_name(const ValuePtr& v);
bool is_bool(const ValuePtr& v);
bool is_optional(const ValuePtr& v);
bool is_set(const ValuePtr& v);  // false only for an unset optional

// The value as a TOML literal (`8`, `0.0008`, `"c4"`, `["model", "loss"]`, `[["a", "b"], ["c"]]`); "none" for
// an unset optional.
std::string format_value(const ValuePtr& v);

// Stores a TOML node into the field; `where` (file:line:col) goes into the error of a wrong type.
void set_from_toml(const FieldRef& f, const toml::node& node, const std::string& where);
// Stores a command-line string: booleans true/false/1/0/yes/no, lists comma-separated, lists of
// lists ';'-separated lists ("a,b;c" is [["a", "b"], ["c"]]), optionals also accept "none".
void set_from_string(const FieldRef& f, std::string_view text, const std::string& where);

// Parses a boolean literal (true/false/1/0/yes/no/on/off, any case).
std::optional<bool> parse_bool(std::string_view text);

// Collects FieldRefs: the visitor that the sections' visit() lists are run with.
class FieldCollector {
 public:
  template <class S>
  void section(S& s, const char* name, const char* help) {
    section_ = name;
    s.visit(*this);
  }
  template <class T>
  void operator()(T& field, const char* key, const char* help, std::initializer_list<const char*> choices = {}) {
    FieldRef f{section_, key, help, {}, ValuePtr(&field)};
    for (const char* c : choices) f.choices.emplace_back(c);
    fields.push_back(std::move(f));
  }
  std::vector<FieldRef> fields;

 private:
  std::string section_;
};

}  // namespace titan::config
