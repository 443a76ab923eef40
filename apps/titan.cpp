// titan: the one binary. Every subcommand reads the same config: defaults < --job.config_file TOML
// < --section.key overrides (see `titan train --help`).
//
//   titan train     [--job.config_file F] [--section.key value ...]   train (torchtitan's log lines)
//   titan estimate  [...]                                             parameters, FLOPs/token, memory
//   titan tokenize  --output DIR [...]                                pre-tokenize the dataset to shards
//   titan convert   to-hf|from-hf SRC DST [...]                       checkpoint <-> Hugging Face folder
#include "titan/common/error.h"
#include "titan/components/data/dataloader.h"
#include "titan/components/data/token_shards.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/config/job_config.h"
#include "titan/distributed/launcher.h"
#include "titan/tools/convert.h"
#include "titan/tools/estimate.h"
#include "titan/trainer/trainer.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace {

const char* kUsage =
    "usage: titan <command> [--job.config_file FILE.toml] [--section.key value ...]\n"
    "commands:\n"
    "  train      train a model (the log line and metrics of torchtitan)\n"
    "  estimate   parameters, training FLOPs per token and memory of [model] name/flavor at [training] seq_len\n"
    "  launch     --nproc-per-node N [...] -- train ...: start N training processes (like torchrun);\n"
    "             see titan launch --help\n"
    "  tokenize   --output DIR: tokenize [training] dataset/dataset_path with [model] hf_assets_path into\n"
    "             binary shards; train on them with --training.dataset_path DIR\n"
    "  convert    to-hf CHECKPOINT_STEP_DIR OUT_DIR | from-hf HF_DIR OUT_CHECKPOINT_DIR: a titan checkpoint\n"
    "             to a Hugging Face model folder (transformers) and back; see titan convert --help\n"
    "Options of every command: titan <command> --help\n";

int run_estimate(const titan::JobConfig& cfg) {
  std::cout << titan::format_estimate(
      titan::estimate_model(cfg.model.name, cfg.model.flavor, cfg.training.seq_len));
  return 0;
}

int run_tokenize(std::vector<std::string> args) {
  std::string output;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--output" || args[i] == "-o") {
      TITAN_USER_CHECK(i + 1 < args.size(), "--output needs a folder");
      output = args[i + 1];
      args.erase(args.begin() + i, args.begin() + i + 2);
      break;
    }
    if (args[i].rfind("--output=", 0) == 0) {
      output = args[i].substr(9);
      args.erase(args.begin() + i);
      break;
    }
  }
  TITAN_USER_CHECK(!output.empty(), "titan tokenize needs --output DIR (a new or empty folder for the shards)");
  const titan::JobConfig cfg = titan::parse_config(args);
  auto tokenizer = titan::load_tokenizer(cfg.model.hf_assets_path);
  auto dataset = titan::data::resolve_dataset(cfg.training.dataset, cfg.training.dataset_path);
  TITAN_USER_CHECK(dataset.kind == "text", dataset.path, " is already tokenized");
  titan::data::ShardWriteOptions opts;
  opts.tokenizer_name = cfg.model.hf_assets_path;
  opts.split = dataset.split.empty() ? "train" : dataset.split;
  auto r = titan::data::tokenize_to_shards(dataset.path, *tokenizer, output, opts);
  std::printf("tokenized %lld documents into %lld tokens in %lld shard(s) under %s\n",
              static_cast<long long>(r.num_documents), static_cast<long long>(r.num_tokens),
              static_cast<long long>(r.num_shards), output.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  try {
    if (command == "launch") return titan::dist::run_launcher(args);  // its own options, then a command
    if (command == "convert") return titan::run_convert(args);       // positional folders, then options
    if (command != "train" && command != "estimate" && command != "tokenize") {
      std::fprintf(stderr, "titan: unknown command '%s'\n%s", command.c_str(), kUsage);
      return 2;
    }
    if (titan::help_requested(args)) {
      std::cout << "titan " << command << (command == "tokenize" ? " --output DIR" : "") << " [options]\n\n"
                << titan::config_help();
      return 0;
    }
    if (command == "tokenize") return run_tokenize(args);
    const titan::JobConfig cfg = titan::parse_config(args);
    if (command == "estimate") return run_estimate(cfg);
    return titan::run_training(cfg);
  } catch (const titan::UserError& e) {
    std::fprintf(stderr, "titan %s: error: %s\n", command.c_str(), e.what());
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "titan %s: error from LibTorch: %s\n", command.c_str(), e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {  // e.g. a file system error: reported, not an abort
    std::fprintf(stderr, "titan %s: error: %s\n", command.c_str(), e.what());
    return 1;
  }
}
