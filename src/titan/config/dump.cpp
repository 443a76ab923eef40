// to_toml and config_help: both are the visit() lists, printed.
#include "titan/config/field.h"
#include "titan/config/job_config.h"
#include "titan/config/legacy.h"
#include "titan/config/suggest.h"
#include "titan/common/error.h"

#include <sstream>
#include <variant>

namespace titan {

namespace {

using config::FieldRef;

std::string metavar(const FieldRef& f) {
  return std::visit(
      [](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) return "[BOOL]";
        else if constexpr (std::is_same_v<T, int64_t>) return "INT";
        else if constexpr (std::is_same_v<T, double>) return "FLOAT";
        else if constexpr (std::is_same_v<T, std::string>) return "STR";
        else if constexpr (std::is_same_v<T, std::vector<std::string>>) return "A,B,...";
        else if constexpr (std::is_same_v<T, std::vector<int64_t>>) return "N,M,...";
        else if constexpr (std::is_same_v<T, std::vector<std::vector<std::string>>>) return "A,B;C,...";
        else if constexpr (std::is_same_v<T, std::optional<int64_t>>) return "INT|none";
        else return "FLOAT|none";
      },
      f.value);
}

std::string legacy_meaning(const config::LegacyKey& l) {
  using K = config::LegacyKind;
  switch (l.kind) {
    case K::Rename: return std::string("same as ") + l.target;
    case K::Negate: return std::string("the opposite of ") + l.target;
    case K::Float8Switch: return std::string("true adds \"") + config::kFloat8Converter + "\" to model.converters";
    case K::FixedValue: {
      std::string values = l.target;
      for (size_t bar; (bar = values.find('|')) != std::string::npos;) values.replace(bar, 1, "\", \"");
      return "only \"" + values + "\" (" + l.note + ")";
    }
    case K::NoEffect: return std::string("accepted, no effect: ") + l.note;
    case K::OffOnly: return std::string("only false: ") + l.note;
    case K::EmptyOnly: return std::string("only empty: ") + l.note;
  }
  return "";
}

}  // namespace

std::string to_toml(const JobConfig& cfg) {
  JobConfig copy = cfg;  // fields_of needs a mutable config; the copy is only read
  const auto fields = config::fields_of(copy);
  std::ostringstream os;
  os << "# Resolved titan config; run it again with --job.config_file <this file>.\n";
  std::string section;
  for (const auto& f : fields) {
    if (f.section != section) {
      section = f.section;
      os << "\n[" << section << "]\n";
    }
    if (config::is_set(f.value)) {
      os << f.key << " = " << config::format_value(f.value) << "\n";
    } else {
      os << "# " << f.key << " is unset: " << f.help << "\n";
    }
  }
  return os.str();
}

namespace {

void field_help(std::ostringstream& os, const FieldRef& f) {
  os << "  --" << f.path() << " " << metavar(f) << "  (default: " << config::format_value(f.value) << ")\n";
  os << "      " << f.help;
  if (!f.choices.empty()) {
    os << "; one of:";
    for (const auto& c : f.choices) os << " \"" << c << "\"";
  }
  os << "\n";
}

}  // namespace

std::string config_help(const std::string& topic_arg) {
  JobConfig defaults;
  const auto fields = config::fields_of(defaults);
  std::ostringstream os;
  // A topic: a section ("training", "[training]"), a key or key prefix ("training.seq",
  // "--training.seq_len"), else the keys whose path contains it ("seq_len").
  std::string topic = topic_arg;
  if (topic.rfind("--", 0) == 0) topic = topic.substr(2);
  if (topic.size() > 2 && topic.front() == '[' && topic.back() == ']') topic = topic.substr(1, topic.size() - 2);
  if (!topic_arg.empty()) {
    std::vector<const FieldRef*> chosen;
    for (const auto& f : fields)
      if (f.section == topic || f.path().rfind(topic, 0) == 0) chosen.push_back(&f);
    if (chosen.empty())
      for (const auto& f : fields)
        if (f.path().find(topic) != std::string::npos) chosen.push_back(&f);
    if (chosen.empty()) {
      std::vector<std::string> names;
      for (const auto& s : config::sections()) names.push_back(s.name);
      for (const auto& f : fields) names.push_back(f.path());
      const auto near = config::nearest(topic, names);
      std::string list;
      for (const auto& s : config::sections()) list += (list.empty() ? "" : ", ") + s.name;
      throw UserError("--help " + topic_arg + ": no section or option matches" +
                      (near ? " (did you mean " + *near + "?)" : "") + "; the sections are " + list +
                      ". --help alone lists every option");
    }
    std::string section;
    for (const FieldRef* f : chosen) {
      if (f->section != section) {
        section = f->section;
        for (const auto& s : config::sections())
          if (s.name == section) os << (os.tellp() > 0 ? "\n" : "") << "[" << s.name << "]  " << s.help << "\n";
      }
      field_help(os, *f);
    }
    return os.str();
  }
  os << "Options: --section.key VALUE or --section.key=VALUE (later ones win). Booleans may be bare\n"
        "(--compile.enable) or take true/false; --section.no_key sets one to false. Lists are\n"
        "comma-separated (--compile.components model,loss); lists of lists separate the lists with ';'\n"
        "(--parallelism.module_fqns_per_model_part \"tok_embeddings,layers.0;layers.1,norm,output\").\n"
        "--job.config_file FILE reads a TOML file with the same keys under [section] tables; the command\n"
        "line overrides the file, the file the defaults. --help SECTION (or a key prefix, e.g.\n"
        "--help training.seq) shows only those options.\n";
  for (const auto& s : config::sections()) {
    os << "\n[" << s.name << "]  " << s.help << "\n";
    for (const auto& f : fields)
      if (f.section == s.name) field_help(os, f);
  }
  os << "\nOlder torchtitan spellings, accepted in files and on the command line:\n";
  for (const auto& l : config::legacy_keys())
    os << "  [" << l.section << "] " << l.key << ": " << legacy_meaning(l) << "\n";
  return os.str();
}

}  // namespace titan
