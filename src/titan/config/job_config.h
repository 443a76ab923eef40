// JobConfig: everything a training job is configured by, one struct per TOML table, with
// torchtitan's table names, key names and defaults. Each component takes only its own section.
//
//   JobConfig cfg = parse_config(args);   // defaults < TOML file (--job.config_file) < --section.key
//   check_supported(cfg, world_size);       // features titan does not have yet are an error
//
// Both generations of torchtitan TOML files are accepted (older `[training] batch_size`,
// `[experimental] pipeline_parallel_degree`, `[float8]`, ...): legacy.h maps them onto the newer
// keys declared here. docs/configs.md describes the whole scheme.
#pragma once

#include "titan/config/sections_run.h"
#include "titan/config/sections_train.h"

#include <string>
#include <vector>

namespace titan {

struct JobConfig {
  config::Job job;
  config::Profiling profiling;
  config::Metrics metrics;
  config::Model model;
  config::Optimizer optimizer;
  config::LRScheduler lr_scheduler;
  config::Training training;
  config::Parallelism parallelism;
  config::Checkpoint checkpoint;
  config::ActivationCheckpoint activation_checkpoint;
  config::Compile compile;
  config::Float8Linear float8;  // TOML table [quantize.linear.float8]
  config::Float8GroupedMM float8_grouped;  // TOML table [quantize.grouped_mm.float8]
  config::Comm comm;
  config::FaultTolerance fault_tolerance;
  config::Experimental experimental;
  config::Validation validation;
  config::Debug debug;

  // The one list of tables, in the order of --help and the dump. v.section(s, name, help) is
  // expected to call s.visit(...) with a field visitor.
  template <class V>
  void visit(V& v) {
    v.section(job, "job", "the job: config file, output folder");
    v.section(profiling, "profiling", "profiler traces and memory snapshots");
    v.section(metrics, "metrics", "metric logging");
    v.section(model, "model", "which model to build");
    v.section(optimizer, "optimizer", "the optimizer");
    v.section(lr_scheduler, "lr_scheduler", "learning-rate schedule: warmup, stable, decay");
    v.section(training, "training", "data, batch and length, steps, precision");
    v.section(parallelism, "parallelism", "parallelism degrees and their options");
    v.section(checkpoint, "checkpoint", "saving and resuming");
    v.section(activation_checkpoint, "activation_checkpoint", "recomputing activations to save memory");
    v.section(compile, "compile", "graph compilation");
    v.section(float8, "quantize.linear.float8", "float8 training of linear layers (older table: [float8])");
    v.section(float8_grouped, "quantize.grouped_mm.float8", "float8 grouped matmuls of MoE experts");
    v.section(comm, "comm", "collective communication");
    v.section(fault_tolerance, "fault_tolerance", "fault-tolerant training");
    v.section(experimental, "experimental", "extension modules");
    v.section(validation, "validation", "validation loss during training");
    v.section(debug, "debug", "seeds and determinism");
  }
  bool operator==(const JobConfig&) const = default;
};

// Parses the arguments that follow the subcommand: `--job.config_file PATH` loads a TOML file,
// then each `--section.key value` / `--section.key=value` overrides it (later ones win).
// Booleans may be bare (`--compile.enable`) or take true/false; lists are comma-separated.
// Older torchtitan spellings are accepted in both the file and the command line. Unknown keys,
// wrong types, values outside a closed set and invalid settings (validate_config) throw
// titan::UserError naming the key, where it was given, and the nearest valid key.
JobConfig parse_config(const std::vector<std::string>& args);

// Parses TOML text as if it were the file `source_name` (no command line); for tests and tools.
JobConfig parse_config_text(const std::string& toml_text, const std::string& source_name = "<string>");

// Takes a tool's own option `name` (`--name V` or `--name=V`) out of args into value; false when
// absent, UserError when it has no value. What remains goes to parse_config.
bool take_option(std::vector<std::string>& args, const std::string& name, std::string& value);

// True when the arguments ask for help (--help or -h); callers then print config_help(help_topic(args)).
bool help_requested(const std::vector<std::string>& args);
// What the help is asked about: the argument after --help / -h when it is not an option
// (`--help training`), or --help=TOPIC; "" for all.
std::string help_topic(const std::vector<std::string>& args);

// Every option grouped by table: name, type, default, help, allowed values; then the older
// spellings that are still accepted. With a topic, only the options of that section, key or key
// prefix (else those whose name contains it); UserError naming the sections when none matches.
std::string config_help(const std::string& topic = "");

// The resolved config as a TOML document that parses back to the same config (unset optional
// values are written as comments).
std::string to_toml(const JobConfig& cfg);

// Sanity checks that hold whatever the features are (positive steps, batch sizes, seq_len, ...).
// Throws titan::UserError naming the key. parse_config calls it.
void validate_config(const JobConfig& cfg);

// The global batch in sequences over `dp_degree` data-parallel ranks (training.global_batch_size, or
// -1: local_batch_size x dp_degree); throws titan::UserError unless it is a whole number of
// local batches on every rank (the gradient accumulation steps).
int64_t global_batch_size(const JobConfig& cfg, int64_t dp_degree);

// Settings that are legal but worth telling the user about (e.g. warmup longer than the run,
// which the schedule clamps as torchtitan does).
std::vector<std::string> config_warnings(const JobConfig& cfg);

// The feature gate (supported.cpp): throws titan::UserError if the config switches on a feature
// titan does not implement yet, naming the key and how to switch it off. `world_size` resolves
// data_parallel_shard_degree = -1.
void check_supported(const JobConfig& cfg, int64_t world_size = 1);

}  // namespace titan
