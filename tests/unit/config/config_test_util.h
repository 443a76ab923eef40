// Shared helpers of the config tests.
#pragma once

#include "titan/common/error.h"
#include "titan/config/field.h"
#include "titan/config/job_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace titan::test {

inline std::string fixture(const std::string& name) {
  // (appended in place: GCC 12 misreads `std::string(dir) + "literal" + name` here as out of bounds)
  std::string path = TITAN_SOURCE_DIR;
  path.append("/tests/unit/config/fixtures/").append(name);
  return path;
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// The value of option `path` ("section.key") as a TOML literal.
inline std::string value_of(const JobConfig& cfg, const std::string& path) {
  JobConfig copy = cfg;
  const auto fields = config::fields_of(copy);
  const size_t dot = path.rfind('.');
  const config::FieldRef* f = config::find_field(fields, path.substr(0, dot), path.substr(dot + 1));
  if (!f) ADD_FAILURE() << "no option " << path;
  return f ? config::format_value(f->value) : "";
}

// The message of the titan::UserError that `fn` throws ("" and a test failure if none).
template <class Fn>
std::string user_error(Fn&& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a titan::UserError";
  return "";
}

inline JobConfig parse(std::vector<std::string> args) { return parse_config(args); }

}  // namespace titan::test
