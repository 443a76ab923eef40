// titan: the one binary. Every subcommand reads the same config: defaults < --job.config_file TOML
// < --section.key overrides (see `titan train --help`).
//
//   titan train     [--job.config_file F] [--section.key value ...]   train (torchtitan's log lines)
//   titan estimate  [--world-size N] [--device cuda|cpu] [...]       per-rank memory, FLOPs, communication
//   titan tokenize  --output DIR [...]                                pre-tokenize the dataset to shards
//   titan convert   to-hf|from-hf|to-dcp|from-dcp|to-torch SRC DST   checkpoint <-> Hugging Face folder, torch.distributed.checkpoint; torch.save file
//   titan report    DUMP_FOLDER... [--output F] | --check RUN_A RUN_B  metrics page; compare loss curves
//   titan config    [--world-size N] [...]                            the resolved config as TOML, checked
#include "titan/common/error.h"
#include "titan/components/data/dataloader.h"
#include "titan/components/data/token_shards.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/config/job_config.h"
#include "titan/distributed/options.h"
#include "titan/launch/launcher.h"
#include "titan/tools/convert.h"
#include "titan/tools/estimate.h"
#include "titan/tools/preflight.h"
#include "titan/tools/report.h"
#include "titan/trainer/trainer.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include <charconv>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <optional>
#include <thread>
#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

namespace titan {
const char* build_version();  // generated at build time (cmake/version.cmake)
const char* build_commit();
}  // namespace titan

namespace {

// `titan --version`: what was built, from which commit, against which LibTorch, with or without CUDA.
void print_version() {
  std::printf("titan %s (commit %s)\n", titan::build_version(), titan::build_commit());
#ifdef USE_C10D_NCCL
  const char* build = "CUDA build with NCCL";
#else
  const char* build = "CPU-only build";
#endif
  std::printf("LibTorch %s, %s; ", TORCH_VERSION, build);
  if (at::hasCUDA())
    std::printf("%d GPU(s) visible\n", static_cast<int>(torch::cuda::device_count()));
  else
    std::printf("no GPU visible: runs on the CPU\n");
}

const char* kUsage =
    "usage: titan <command> [--job.config_file FILE.toml] [--section.key value ...]\n"
    "commands:\n"
    "  train      train a model (the log line and metrics of torchtitan)\n"
    "  estimate   per-rank memory (peak, and whether it fits), FLOPs and communication per step of the config's\n"
    "             run, from a dry run on the meta device; see titan estimate --help\n"
    "  launch     --nproc-per-node N [...] -- train ...: start N training processes (like torchrun);\n"
    "             see titan launch --help\n"
    "  tokenize   --output DIR [--workers N]: tokenize [training] dataset/dataset_path with [model]\n"
    "             hf_assets_path into binary shards on every core (or N threads; under titan launch each\n"
    "             process takes its part of the files and its share of the node's cores); train on them with\n"
    "             --training.dataset_path DIR\n"
    "  convert    to-hf CHECKPOINT_STEP_DIR OUT_DIR | from-hf HF_DIR OUT_CHECKPOINT_DIR: a titan checkpoint\n"
    "             to a Hugging Face model folder (transformers) and back; from-dcp DCP_STEP_DIR\n"
    "             OUT_CHECKPOINT_DIR: a torch.distributed.checkpoint (torchtitan) in; to-dcp, to-torch: the\n"
    "             model out as one, or as a torch.save file; see titan convert --help\n"
    "  config     [--world-size N]: print the resolved config (defaults < file < command line, older keys\n"
    "             mapped) as TOML, after the checks titan train makes of it (for N ranks, default 1), and its\n"
    "             warnings; nothing is built or read\n"
    "  report     DUMP_FOLDER [DUMP_FOLDER ...]: one HTML page plotting the runs' metrics (loss, lr, MFU, ...)\n"
    "             and their config differences; --check RUN_A RUN_B compares two loss curves step by step;\n"
    "             see titan report --help\n"
    "Options of every command: titan <command> --help [SECTION]; titan --version: build and commit\n";

const char* kEstimateUsage =
    "titan estimate [--world-size N] [--device cuda|cpu] [--device-memory-gib G] [config options]\n\n"
    "Predicts, for one rank of the run the config describes, the memory it holds (parameters, gradients,\n"
    "optimizer state, communication buffers, activations and the peak), its training FLOPs per step and\n"
    "the bytes it communicates per step per mesh dimension, and says whether the peak fits the device.\n"
    "Under pipeline parallelism every pipeline rank is estimated under the schedule (each rank's stages,\n"
    "microbatches in flight and peak are listed) and the figures are the worst rank's.\n"
    "  --world-size N          ranks of the run (resolves data_parallel_shard_degree -1); default: the\n"
    "                          product of the configured degrees, -1 counting as 1\n"
    "  --device cuda|cpu       what the ranks compute on (default cuda: mixed_precision_param applies;\n"
    "                          cpu: fp32, and the peak is the log line's memory figure)\n"
    "  --device-memory-gib G   device capacity for the verdict (default 80)\n\n";

using titan::take_option;

int run_estimate(std::vector<std::string> args) {
  titan::EstimateOptions opts;
  std::string v;
  try {
    if (take_option(args, "--world-size", v)) {
      opts.world_size = std::stoll(v);
      TITAN_USER_CHECK(opts.world_size >= 1, "--world-size must be a positive integer, got ", v);
    }
    if (take_option(args, "--device-memory-gib", v)) opts.device_memory_gib = std::stod(v);
  } catch (const std::logic_error&) {
    throw titan::UserError("--world-size takes an integer and --device-memory-gib a number, got '" + v + "'");
  }
  if (take_option(args, "--device", v)) opts.device = v;
  const titan::JobConfig cfg = titan::parse_config(args);
  std::cout << titan::format_estimate(titan::estimate(cfg, opts));
  return 0;
}

int run_tokenize(std::vector<std::string> args) {
  std::string output;
  int workers = 0;
  for (size_t i = 0; i < args.size();) {
    const std::string& a = args[i];
    auto value = [&](const std::string& name) {
      if (a == name) {
        TITAN_USER_CHECK(i + 1 < args.size(), name, " needs a value");
        std::string v = args[i + 1];
        args.erase(args.begin() + static_cast<std::ptrdiff_t>(i), args.begin() + static_cast<std::ptrdiff_t>(i) + 2);
        return std::optional<std::string>(v);
      }
      if (a.rfind(name + "=", 0) == 0) {
        std::string v = a.substr(name.size() + 1);
        args.erase(args.begin() + static_cast<std::ptrdiff_t>(i));
        return std::optional<std::string>(v);
      }
      return std::optional<std::string>();
    };
    if (auto v = a == "-o" ? value("-o") : value("--output")) {
      output = *v;
    } else if (auto w = value("--workers")) {
      char* end = nullptr;
      const long n = std::strtol(w->c_str(), &end, 10);
      TITAN_USER_CHECK(end && *end == '\0' && n >= 0 && n <= 4096, "--workers ", *w,
                       ": give a number of threads (0: one per core)");
      workers = static_cast<int>(n);
    } else {
      ++i;
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
  opts.workers = workers;
  opts.text_field = cfg.training.dataset_text_field;
  // Started by a launcher (titan launch, torchrun): each process takes its part of the files.
  if (const char* rank = std::getenv("RANK"), *world = std::getenv("WORLD_SIZE"); rank && world) {
    opts.process = std::atoi(rank);
    opts.processes = std::atoi(world);
    TITAN_USER_CHECK(opts.processes >= 1 && opts.process >= 0 && opts.process < opts.processes, "RANK ", rank,
                     " and WORLD_SIZE ", world, " do not describe a process of the job");
    // The processes of one node share its cores: each takes its share unless --workers says otherwise.
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    if (workers == 0 && local && std::atoi(local) > 1)
      opts.workers = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / std::atoi(local));
  }
  const auto start = std::chrono::steady_clock::now();
  auto r = titan::data::tokenize_to_shards(dataset.path, *tokenizer, output, opts);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (opts.process == 0)
    std::printf("tokenized %lld documents into %lld tokens in %lld shard(s) under %s (%d process(es) of %d "
                "thread(s); this process %.1f s, %.0f tokens/s)\n",
                static_cast<long long>(r.num_documents), static_cast<long long>(r.num_tokens),
                static_cast<long long>(r.num_shards), output.c_str(), opts.processes, r.workers, seconds,
                static_cast<double>(r.own_tokens) / std::max(seconds, 1e-9));
  return 0;
}

// `titan config`: what a run of these arguments would be configured with (torchtitan's
// `python -m torchtitan.config.manager`), checked as titan train checks it.
int run_config(std::vector<std::string> args) {
  std::string world_text = "1";
  take_option(args, "--world-size", world_text);
  int64_t world = 0;
  const char* end = world_text.data() + world_text.size();
  const auto [at, ec] = std::from_chars(world_text.data(), end, world);
  TITAN_USER_CHECK(ec == std::errc() && at == end && world >= 1, "--world-size takes a positive number of ranks, not '",
                   world_text, "'");
  const titan::JobConfig cfg = titan::parse_config(args);
  // The layout over N ranks and the batch it splits, as titan train checks them before building anything.
  const titan::dist::ParallelDims dims = titan::dist::parallel_dims(cfg.parallelism, world);
  titan::check_supported(cfg, world);
  (void)titan::global_batch_size(cfg, dims.dp_size());
  for (const auto& w : titan::config_warnings(cfg)) std::fprintf(stderr, "titan config: warning: %s\n", w.c_str());
  std::cout << titan::to_toml(cfg);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  titan::set_memory_budget_planner(titan::memory_budget_plan);
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "--version") || !std::strcmp(argv[1], "version")) {
    print_version();
    return 0;
  }
  const std::string command = argv[1];
  const std::vector<std::string> args(argv + 2, argv + argc);
  try {
    if (command == "launch") return titan::dist::run_launcher(args);  // its own options, then a command
    if (command == "convert") return titan::run_convert(args);       // positional folders, then options
    if (command == "report") return titan::report::run_report(args);  // its own options; exit 2 on bad input
    if (command != "train" && command != "estimate" && command != "tokenize" && command != "config") {
      std::fprintf(stderr, "titan: unknown command '%s'\n%s", command.c_str(), kUsage);
      return 2;
    }
    if (titan::help_requested(args)) {
      const std::string topic = titan::help_topic(args);
      if (!topic.empty()) {  // one section or key prefix: `titan train --help training`
        std::cout << titan::config_help(topic);
        return 0;
      }
      if (command == "estimate")
        std::cout << kEstimateUsage;
      else if (command == "config")
        std::cout << "titan config [--world-size N] [options]: the resolved config as TOML (stdout), checked as "
                     "titan train checks it for N ranks (default 1); its warnings on stderr\n\n";
      else
        std::cout << "titan " << command << (command == "tokenize" ? " --output DIR" : "") << " [options]\n\n";
      std::cout << titan::config_help();
      return 0;
    }
    if (command == "tokenize") return run_tokenize(args);
    if (command == "estimate") return run_estimate(args);
    if (command == "config") return run_config(args);
    const titan::JobConfig cfg = titan::parse_config(args);
    return titan::run_training(cfg, [&cfg] { titan::check_memory_fits(cfg); });
  } catch (const titan::Preempted&) {  // rank 0 logged the stop step and its checkpoint
    return titan::kExitPreempted;
  } catch (const titan::RunStopped& e) {
    std::fprintf(stderr, "titan %s: error: %s\n", command.c_str(), e.what());
    return titan::kExitStopped;
  } catch (const titan::LaunchRefused& e) {
    std::fprintf(stderr, "titan %s: error: %s\n", command.c_str(), e.what());
    return titan::kExitLaunchRefused;
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
