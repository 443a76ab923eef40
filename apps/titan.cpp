// titan: the one binary. Subcommands:
//   titan estimate --model.name llama3 --model.flavor 8B [--training.seq_len 8192]
#include "titan/common/error.h"
#include "titan/tools/estimate.h"

#include <cstdio>
#include <cstring>
#include <iostream>
#include <map>
#include <string>

namespace {

const char* kUsage =
    "usage: titan <command> [--section.key value ...]\n"
    "commands:\n"
    "  estimate   parameters, training FLOPs per token and memory of a model flavor\n"
    "             --model.name NAME (llama3)  --model.flavor FLAVOR (debugmodel)  --training.seq_len N (2048)\n";

// --section.key value | --section.key=value, restricted to `allowed` keys (name -> default).
std::map<std::string, std::string> parse_overrides(int argc, char** argv, std::map<std::string, std::string> allowed) {
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    TITAN_USER_CHECK(arg.rfind("--", 0) == 0, "unexpected argument '", arg, "'\n", kUsage);
    std::string key = arg.substr(2), value;
    if (auto eq = key.find('='); eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    } else {
      TITAN_USER_CHECK(i + 1 < argc, "--", key, " needs a value");
      value = argv[++i];
    }
    TITAN_USER_CHECK(allowed.count(key), "unknown option --", key, "\n", kUsage);
    allowed[key] = value;
  }
  return allowed;
}

int run_estimate(int argc, char** argv) {
  auto opts = parse_overrides(argc, argv, {{"model.name", "llama3"}, {"model.flavor", "debugmodel"},
                                           {"training.seq_len", "2048"}});
  int64_t seq_len = 0;
  try {
    seq_len = std::stoll(opts["training.seq_len"]);
  } catch (const std::exception&) {
    throw titan::UserError("--training.seq_len expects an integer, got '" + opts["training.seq_len"] + "'");
  }
  TITAN_USER_CHECK(seq_len > 0, "--training.seq_len must be positive");
  std::cout << titan::format_estimate(titan::estimate_model(opts["model.name"], opts["model.flavor"], seq_len));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  try {
    if (command == "estimate") return run_estimate(argc - 2, argv + 2);
    std::fprintf(stderr, "titan: unknown command '%s'\n%s", command.c_str(), kUsage);
    return 2;
  } catch (const titan::UserError& e) {
    std::fprintf(stderr, "titan %s: error: %s\n", command.c_str(), e.what());
    return 1;
  }
}
