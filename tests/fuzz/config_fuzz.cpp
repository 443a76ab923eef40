// Fuzz target: the config layer. Input: a TOML file, optionally followed (after the file separator)
// by command-line overrides, one argument per line. Parsed as `titan train --job.config_file F args...`
// would parse them, then the feature gate and the warnings run, and a config that parses must dump
// (to_toml) to a TOML text that parses back to the same config.
#include "fuzz_util.h"

#include "titan/config/job_config.h"

namespace {

std::vector<std::string> lines_of(std::string_view text) {
  std::vector<std::string> out;
  while (!text.empty() && out.size() < 64) {
    const size_t nl = text.find('\n');
    out.emplace_back(text.substr(0, nl));
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  const auto parts = fuzz::split_files(data, size, 2);
  const std::string path = fuzz::fresh_dir() + "/job.toml";
  fuzz::write_file(path, parts[0]);
  std::vector<std::string> args = {"--job.config_file", path};
  if (parts.size() > 1) {
    for (auto& a : lines_of(parts[1])) {
      // Another config file would read whatever file the input names.
      if (a.find("config_file") != std::string::npos || a.find("config-file") != std::string::npos) continue;
      args.push_back(std::move(a));
    }
  }
  if (help_requested(args)) return 0;  // the caller prints config_help() instead of parsing
  return fuzz::run_one("config", [&] {
    const JobConfig cfg = parse_config(args);
    (void)config_warnings(cfg);
    for (int64_t world : {1, 8}) {
      try {
        check_supported(cfg, world);
      } catch (const UserError&) {
      }
    }
    const std::string dumped = to_toml(cfg);
    JobConfig again;
    try {
      again = parse_config_text(dumped, "<dump>");
    } catch (const UserError& e) {
      TITAN_FUZZ_CHECK(false, "the dump of a valid config does not parse back: ", e.what(), "\n", dumped);
    }
    TITAN_FUZZ_CHECK(to_toml(again) == dumped, "the dump parses back to another config:\n", dumped, "\n---\n",
                     to_toml(again));
  });
}
