#include "titan/config/layer.h"

#include "titan/common/error.h"
#include "titan/config/suggest.h"

#include <algorithm>

namespace titan::config {

namespace {

std::pair<std::string, std::string> split_path(const std::string& path) {
  const size_t dot = path.rfind('.');
  TITAN_ASSERT(dot != std::string::npos, "not a section.key path: ", path);
  return {path.substr(0, dot), path.substr(dot + 1)};
}

// Fields of a default config: names, types and help only (the pointers are not used).
const std::vector<FieldRef>& default_fields() {
  static JobConfig cfg;
  static const std::vector<FieldRef> fields = fields_of(cfg);
  return fields;
}

bool is_float8_converter(const std::string& name) { return name == kFloat8Converter || name == "float8"; }

}  // namespace

Layer::Layer(JobConfig& cfg) : cfg_(cfg), fields_(fields_of(cfg)) {}

const FieldRef& Layer::field(const std::string& path) const {
  auto [section, key] = split_path(path);
  const FieldRef* f = find_field(fields_, section, key);
  TITAN_ASSERT(f, "older-key table points at a missing option: ", path);
  return *f;
}

bool Layer::takes_bool(const std::string& section, const std::string& key) const {
  if (const FieldRef* f = find_field(fields_, section, key)) return is_bool(f->value);
  if (const LegacyKey* l = find_legacy(section, key)) {
    switch (l->kind) {
      case LegacyKind::Rename: return is_bool(field(l->target).value);
      case LegacyKind::Negate:
      case LegacyKind::Float8Switch:
      case LegacyKind::OffOnly: return true;
      case LegacyKind::EmptyOnly: return false;
      case LegacyKind::NoEffect: return std::string(l->target) == "bool";
      case LegacyKind::FixedValue: return false;
    }
  }
  return false;
}

void Layer::record(const std::string& option, const std::string& spelling, const std::string& where) {
  const std::string value = format_value(field(option).value);
  auto it = seen_.find(option);
  if (it != seen_.end() && it->second.spelling != spelling && it->second.value != value) {
    throw UserError(detail::concat(
        "'", it->second.spelling, "' (", it->second.where, ") and '", spelling, "' (", where,
        ") are two spellings of the same option ", option, " but give it different values (", it->second.value,
        " and ", value, "); keep only '", option, "'"));
  }
  seen_[option] = {spelling, where, value};
}

bool Layer::assign(const std::string& section, const std::string& key, const std::string& where, const Store& store) {
  if (const FieldRef* f = find_field(fields_, section, key)) {
    store(*f);
    // "float8" is the older name of the float8 converter; one name keeps spellings comparable.
    std::replace(cfg_.model.converters.begin(), cfg_.model.converters.end(), std::string("float8"),
                 std::string(kFloat8Converter));
    record(f->path(), f->path(), where);
    return true;
  }
  if (const LegacyKey* l = find_legacy(section, key)) {
    assign_legacy(*l, where, store);
    return true;
  }
  return false;
}

void Layer::assign_legacy(const LegacyKey& legacy, const std::string& where, const Store& store) {
  const std::string spelling = std::string(legacy.section) + "." + legacy.key;
  // Errors name the key as the user wrote it.
  auto as_written = [&](ValuePtr v, std::vector<std::string> choices = {}) {
    return FieldRef{legacy.section, legacy.key, "", std::move(choices), v};
  };
  switch (legacy.kind) {
    case LegacyKind::Rename: {
      FieldRef f = field(legacy.target);
      f.section = legacy.section;
      f.key = legacy.key;
      store(f);
      record(legacy.target, spelling, where);
      return;
    }
    case LegacyKind::Negate: {
      bool value = false;
      store(as_written(&value));
      *std::get<bool*>(field(legacy.target).value) = !value;
      record(legacy.target, spelling, where);
      return;
    }
    case LegacyKind::Float8Switch: {
      bool value = false;
      store(as_written(&value));
      auto& converters = cfg_.model.converters;
      const bool present = std::any_of(converters.begin(), converters.end(), is_float8_converter);
      if (!value) std::erase_if(converters, is_float8_converter);
      if (value && !present) converters.push_back(kFloat8Converter);
      record(legacy.target, spelling, where);
      return;
    }
    case LegacyKind::FixedValue: {
      std::string value;
      std::vector<std::string> choices;
      std::string_view rest = legacy.target;
      for (size_t bar; (bar = rest.find('|')) != std::string_view::npos; rest.remove_prefix(bar + 1))
        choices.emplace_back(rest.substr(0, bar));
      choices.emplace_back(rest);
      try {
        store(as_written(&value, std::move(choices)));
      } catch (const UserError& e) {
        throw UserError(detail::concat(e.what(), " (", legacy.note, ")"));
      }
      return;
    }
    case LegacyKind::OffOnly: {
      bool value = false;
      store(as_written(&value));
      TITAN_USER_CHECK(!value, spelling, " at ", where, ": true is not supported: ", legacy.note,
                       "; remove it or set it to false");
      return;
    }
    case LegacyKind::EmptyOnly: {
      std::vector<std::string> value;
      store(as_written(&value));
      TITAN_USER_CHECK(value.empty(), spelling, " at ", where, ": ", format_value(&value), " is not supported: ",
                       legacy.note, "; remove it or leave it empty");
      return;
    }
    case LegacyKind::NoEffect: {
      bool flag = false;
      int64_t number = 0;
      double real = 0;
      const std::string type = legacy.target;
      TITAN_ASSERT(type == "bool" || type == "int" || type == "float", "older-key table: unknown value type ", type);
      store(type == "bool" ? as_written(&flag) : type == "int" ? as_written(&number) : as_written(&real));
      return;
    }
  }
}

bool is_section_name(const std::string& name) {
  for (const auto& s : sections())
    if (s.name == name) return true;
  return is_legacy_section(name);
}

bool is_table_name(const std::string& name) {
  if (is_section_name(name)) return true;
  for (const auto& s : sections())
    if (s.name.size() > name.size() && s.name.compare(0, name.size(), name) == 0 && s.name[name.size()] == '.')
      return true;
  return false;
}

std::string suggestion(const std::string& section, const std::string& key, const std::string& style) {
  auto show = [&](const std::string& path) {
    if (style == "cli") return "--" + path;
    auto [s, k] = split_path(path);
    return "[" + s + "] " + k;
  };
  auto older = [&](const LegacyKey& l) {
    return "did you mean " + show(l.target) + "? (" + show(std::string(l.section) + "." + l.key) +
           " is its older spelling)";
  };
  // 1. The key exists as written, but in another table (e.g. a degree under [training] that
  //    moved to [parallelism], or an older key typed in the newer table).
  for (const auto& f : default_fields())
    if (f.key == key && f.section != section) return "did you mean " + show(f.path()) + "?";
  for (const auto& l : legacy_keys())
    if (key == l.key && section != l.section) {
      if (l.kind == LegacyKind::Rename || l.kind == LegacyKind::Negate || l.kind == LegacyKind::Float8Switch)
        return older(l);
      if (l.kind == LegacyKind::OffOnly || l.kind == LegacyKind::EmptyOnly)
        return "did you mean " + show(std::string(l.section) + "." + l.key) + "?";
    }
  // 2. A typo of a key of this table, older spellings included.
  std::vector<std::string> local;
  for (const auto& f : default_fields())
    if (f.section == section) local.push_back(f.key);
  for (const auto& l : legacy_keys())
    if (section == l.section) local.push_back(l.key);
  if (auto near = nearest(key, local)) {
    if (const LegacyKey* l = find_legacy(section, *near);
        l && (l->kind == LegacyKind::Rename || l->kind == LegacyKind::Negate))
      return older(*l);
    return "did you mean " + show(section + "." + *near) + "?";
  }
  // 3. A typo of a key of another table, then a typo anywhere (table name included).
  std::vector<std::string> keys, paths;
  for (const auto& f : default_fields()) {
    keys.push_back(f.key);
    paths.push_back(f.path());
  }
  if (auto near = nearest(key, keys)) {
    for (const auto& f : default_fields())
      if (f.key == *near) return "did you mean " + show(f.path()) + "?";
  }
  if (auto near = nearest(section + "." + key, paths)) return "did you mean " + show(*near) + "?";
  return "";
}

}  // namespace titan::config
