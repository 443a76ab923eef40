// parse_config: defaults, then the TOML file, then the command line.
#include "titan/common/error.h"
#include "titan/common/utf8.h"
#include "titan/config/field.h"
#include "titan/config/job_config.h"
#include "titan/config/layer.h"
#include "titan/config/legacy.h"
#include "titan/config/suggest.h"

#include <toml++/toml.h>

#include <filesystem>
#include <optional>

namespace titan {

namespace {

using config::FieldRef;
using config::Layer;

std::string position(const std::string& source, const toml::source_region& region) {
  return detail::concat(source, ":", region.begin.line, ":", region.begin.column);
}

// Walks the tables of a parsed TOML document and assigns every key. `prefix` is the dotted name
// of `table` ("" for the root).
void apply_table(const toml::table& table, const std::string& prefix, const std::string& source, Layer& layer) {
  const bool in_section = !prefix.empty() && config::is_section_name(prefix);
  for (auto&& [k, node] : table) {
    const std::string name(k.str());
    const std::string path = prefix.empty() ? name : prefix + "." + name;
    const std::string where = position(source, k.source());
    if (in_section) {
      // (node is captured through a reference of its own: clang before 16 cannot capture structured bindings)
      const config::Store store = [&, &value = node](const FieldRef& f) { config::set_from_toml(f, value, where); };
      if (layer.assign(prefix, name, where, store)) continue;
    }
    if (node.is_table() && config::is_table_name(path)) {
      apply_table(*node.as_table(), path, source, layer);
      continue;
    }
    if (const char* reason = config::unsupported_reason(path))
      throw UserError(detail::concat(node.is_table() ? "[" + path + "]" : path, " at ", where, ": ", reason));
    if (!in_section && node.is_table()) {
      std::vector<std::string> tables;
      for (const auto& s : config::sections()) tables.push_back(s.name);
      std::string hint;
      if (auto near = config::nearest(path, tables)) hint = "; did you mean [" + *near + "]?";
      throw UserError(detail::concat("unknown table [", path, "] at ", where, hint));
    }
    if (prefix.empty()) {
      std::string hint = config::suggestion("", name, "toml");
      throw UserError(detail::concat("key '", name, "' at ", where, " is outside any table",
                                     hint.empty() ? "" : "; " + hint));
    }
    std::string hint = config::suggestion(prefix, name, "toml");
    throw UserError(detail::concat("unknown key '", name, "' in [", prefix, "] at ", where,
                                   hint.empty() ? "" : "; " + hint,
                                   " (run with --help to list every key)"));
  }
}

void apply_toml_text(const std::string& text, const std::string& source, Layer& layer) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw UserError(detail::concat(position(source, e.source()), ": invalid TOML: ", e.description()));
  }
  apply_table(root, "", source, layer);
}

void apply_toml_file(const std::string& path, Layer& layer) {
  namespace fs = std::filesystem;
  std::error_code ec;
  TITAN_USER_CHECK(fs::exists(path, ec), "config file '", path, "' (given by --job.config_file) does not exist",
                   " (current directory: ", fs::current_path(ec).string(), ")");
  TITAN_USER_CHECK(fs::is_regular_file(path, ec), "config file '", path, "' (given by --job.config_file) is not a file");
  toml::table root;
  try {
    root = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw UserError(detail::concat(position(path, e.source()), ": invalid TOML: ", e.description()));
  }
  apply_table(root, "", path, layer);
}

// The value of --job.config_file (either spelling, either form), if given; the last one wins.
std::optional<std::string> config_file_argument(const std::vector<std::string>& args) {
  std::optional<std::string> file;
  for (size_t i = 0; i < args.size(); ++i) {
    for (const char* name : {"--job.config_file", "--job.config-file"}) {
      const std::string n(name);
      if (args[i] == n && i + 1 < args.size()) file = args[i + 1];
      if (args[i].rfind(n + "=", 0) == 0) file = args[i].substr(n.size() + 1);
    }
  }
  return file;
}

void apply_command_line(const std::vector<std::string>& args, Layer& layer) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    TITAN_ASSERT(arg != "--help" && arg != "-h" && arg.rfind("--help=", 0) != 0, "check help_requested() before parse_config()");
    TITAN_USER_CHECK(arg.rfind("--", 0) == 0 && arg.size() > 2, "unexpected argument '", arg,
                     "': options look like --section.key value or --section.key=value (see --help)");
    std::string name = arg.substr(2);
    std::optional<std::string> value;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    for (char& c : name)
      if (c == '-') c = '_';  // --job.config-file is --job.config_file
    const size_t dot = name.rfind('.');
    TITAN_USER_CHECK(dot != std::string::npos && dot > 0 && dot + 1 < name.size(), "option '", arg,
                     "' names no table: options look like --section.key (e.g. --training.steps 10)");
    const std::string section = name.substr(0, dot);
    std::string key = name.substr(dot + 1);

    // --section.no_key turns a boolean off.
    if (!layer.takes_bool(section, key) && key.rfind("no_", 0) == 0 && layer.takes_bool(section, key.substr(3))) {
      TITAN_USER_CHECK(!value, "option '", arg, "' takes no value");
      key = key.substr(3);
      value = "false";
    }
    std::string shown = arg;
    if (!value) {
      if (layer.takes_bool(section, key)) {
        // A bare boolean means true; a following true/false belongs to it.
        if (i + 1 < args.size() && config::parse_bool(args[i + 1])) {
          value = args[++i];
          shown += " " + *value;
        } else {
          value = "true";
        }
      } else {
        TITAN_USER_CHECK(i + 1 < args.size(), "option '", arg, "' needs a value: ", arg, " VALUE or ", arg, "=VALUE");
        value = args[++i];
        shown += " " + *value;
      }
    }
    const std::string where = "command-line argument '" + shown + "'";
    const config::Store store = [&](const FieldRef& f) { config::set_from_string(f, *value, where); };
    if (!layer.assign(section, key, where, store)) {
      if (const char* reason = config::unsupported_reason(section + "." + key))
        throw UserError(detail::concat("--", section, ".", key, " (", where, "): ", reason));
      std::string hint = config::suggestion(section, key, "cli");
      throw UserError(detail::concat("unknown option '--", section, ".", key, "' (", where, ")",
                                     hint.empty() ? "" : "; " + hint, " (run with --help to list every key)"));
    }
  }
}

}  // namespace

bool take_option(std::vector<std::string>& args, const std::string& name, std::string& value) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == name) {
      TITAN_USER_CHECK(i + 1 < args.size(), name, " needs a value");
      value = args[i + 1];
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i), args.begin() + static_cast<std::ptrdiff_t>(i) + 2);
      return true;
    }
    if (args[i].rfind(name + "=", 0) == 0) {
      value = args[i].substr(name.size() + 1);
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(i));
      return true;
    }
  }
  return false;
}

bool help_requested(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h" || a.rfind("--help=", 0) == 0) return true;
  return false;
}

std::string help_topic(const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].rfind("--help=", 0) == 0) return args[i].substr(7);
    if ((args[i] == "--help" || args[i] == "-h") && i + 1 < args.size() && !args[i + 1].empty() &&
        args[i + 1][0] != '-')
      return args[i + 1];
  }
  return "";
}


JobConfig parse_config(const std::vector<std::string>& args) {
  // TOML text is UTF-8 (toml++ checks files); the command line is checked here, so that every value
  // can be written back to a TOML file (the dump folder's config.toml).
  for (size_t i = 0; i < args.size(); ++i)
    TITAN_USER_CHECK(tokenizer::is_valid_utf8(args[i]), "command-line argument ", i + 1, " is not valid UTF-8: options and their "
                     "values must be UTF-8 text");
  JobConfig cfg;
  if (auto file = config_file_argument(args)) {
    Layer from_file(cfg);
    apply_toml_file(*file, from_file);
  }
  Layer from_command_line(cfg);
  apply_command_line(args, from_command_line);
  validate_config(cfg);
  return cfg;
}

JobConfig parse_config_text(const std::string& toml_text, const std::string& source_name) {
  JobConfig cfg;
  Layer from_text(cfg);
  apply_toml_text(toml_text, source_name, from_text);
  validate_config(cfg);
  return cfg;
}

}  // namespace titan
