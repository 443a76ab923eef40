// Config sections about how the job runs: [job], [profiling], [metrics], [parallelism], [comm],
// [fault_tolerance], [experimental], [validation], [debug].
//
// Same conventions as sections_train.h: the member initializer is the default, visit() names each
// field once with its help text (and allowed values where the set is closed).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace titan::config {

struct Job {
  std::string config_file;  // empty: no file, defaults + command line only
  std::string dump_folder = "./outputs";
  std::string description = "default job";
  bool print_config = false;
  std::string save_config_file;  // empty: not saved
  std::string custom_config_module;
  std::vector<std::string> preemption_signals = {"SIGTERM", "SIGUSR1"};
  int64_t preemption_grace_seconds = 0;  // 0: no deadline of titan's own

  template <class V>
  void visit(V& v) {
    v(config_file, "config_file", "TOML file to read; command-line options override it");
    v(dump_folder, "dump_folder", "folder for all outputs: checkpoints, TensorBoard events, traces");
    v(description, "description", "free text describing the job");
    v(print_config, "print_config", "print the resolved config at start-up");
    v(save_config_file, "save_config_file", "write the resolved config to this file inside dump_folder");
    v(custom_config_module, "custom_config_module", "module that extends the config with more sections");
    v(preemption_signals, "preemption_signals",
      "signals that preempt the run: the step in flight finishes, every rank stops at the same step, a "
      "checkpoint of it is saved (with checkpoint.enable) and titan exits with code 75; a second signal exits at "
      "once (SLURM: #SBATCH --signal=USR1@120; [] turns this off)");
    v(preemption_grace_seconds, "preemption_grace_seconds",
      "after a preemption signal, exit at once if the run has not stopped within this many seconds (0: no limit "
      "of titan's own; the scheduler's kill comes anyway)");
  }
  bool operator==(const Job&) const = default;
};

struct Profiling {
  bool enable_profiling = false;
  std::string save_traces_folder = "profile_traces";
  int64_t profile_freq = 10;
  int64_t profiler_active = 1;
  int64_t profiler_warmup = 3;
  bool enable_memory_snapshot = false;
  std::string save_memory_snapshot_folder = "memory_snapshot";

  template <class V>
  void visit(V& v) {
    v(enable_profiling, "enable_profiling", "record profiler traces");
    v(save_traces_folder, "save_traces_folder", "trace folder, relative to job.dump_folder");
    v(profile_freq, "profile_freq", "take a trace every this many steps");
    v(profiler_active, "profiler_active", "steps recorded per trace");
    v(profiler_warmup, "profiler_warmup", "warmup steps before each recorded window");
    v(enable_memory_snapshot, "enable_memory_snapshot", "dump CUDA memory snapshots");
    v(save_memory_snapshot_folder, "save_memory_snapshot_folder", "snapshot folder, relative to job.dump_folder");
  }
  bool operator==(const Profiling&) const = default;
};

struct Metrics {
  int64_t log_freq = 10;
  bool enable_tensorboard = false;
  bool disable_color_printing = false;
  std::string save_tb_folder = "tb";
  bool save_for_all_ranks = false;
  bool enable_wandb = false;

  template <class V>
  void visit(V& v) {
    v(log_freq, "log_freq", "print and record metrics every this many steps");
    v(enable_tensorboard, "enable_tensorboard", "write TensorBoard event files");
    v(disable_color_printing, "disable_color_printing", "print log lines without ANSI colors");
    v(save_tb_folder, "save_tb_folder", "TensorBoard folder, relative to job.dump_folder");
    v(save_for_all_ranks, "save_for_all_ranks", "every rank writes metrics, not only the one that has the loss");
    v(enable_wandb, "enable_wandb", "log metrics to Weights & Biases");
  }
  bool operator==(const Metrics&) const = default;
};

// Degrees multiply to the world size; rank order is pp, dp_replicate, dp_shard, cp, tp.
struct Parallelism {
  int64_t data_parallel_replicate_degree = 1;
  int64_t data_parallel_shard_degree = -1;
  std::string fsdp_reshard_after_forward = "default";
  int64_t tensor_parallel_degree = 1;
  bool enable_sequence_parallel = true;
  bool disable_loss_parallel = false;
  bool enable_async_tensor_parallel = false;
  int64_t pipeline_parallel_degree = 1;
  std::vector<std::string> pipeline_parallel_split_points;
  std::optional<int64_t> pipeline_parallel_layers_per_stage;
  int64_t pipeline_parallel_first_stage_less_layers = 1;
  int64_t pipeline_parallel_last_stage_less_layers = 1;
  std::string pipeline_parallel_schedule = "1F1B";
  std::string pipeline_parallel_schedule_csv;
  int64_t pipeline_parallel_microbatch_size = 1;
  std::vector<std::vector<std::string>> module_fqns_per_model_part;  // empty: the automatic split
  int64_t context_parallel_degree = 1;
  std::string context_parallel_load_balancer = "headtail";
  std::string context_parallel_rotate_method = "allgather";
  int64_t expert_parallel_degree = 1;
  int64_t expert_tensor_parallel_degree = 1;

  template <class V>
  void visit(V& v) {
    v(data_parallel_replicate_degree, "data_parallel_replicate_degree",
      "replicas of the weights (DDP alone, HSDP together with sharding); 1 disables");
    v(data_parallel_shard_degree, "data_parallel_shard_degree",
      "ranks the weights are sharded over (FSDP); -1 takes the ranks left over by the other degrees");
    v(fsdp_reshard_after_forward, "fsdp_reshard_after_forward", "free gathered weights after forward",
      {"default", "always", "never"});
    v(tensor_parallel_degree, "tensor_parallel_degree", "tensor (and sequence) parallel degree; 1 disables");
    v(enable_sequence_parallel, "enable_sequence_parallel",
      "under tensor parallelism, shard norms and the residual stream on the sequence");
    v(disable_loss_parallel, "disable_loss_parallel", "gather the logits before the loss under tensor parallelism");
    v(enable_async_tensor_parallel, "enable_async_tensor_parallel", "overlap tensor-parallel collectives with matmuls");
    v(pipeline_parallel_degree, "pipeline_parallel_degree", "pipeline stages over ranks; 1 disables");
    v(pipeline_parallel_split_points, "pipeline_parallel_split_points",
      "module names where a new stage starts, e.g. layers.4,layers.8");
    v(pipeline_parallel_layers_per_stage, "pipeline_parallel_layers_per_stage",
      "layers per (virtual) stage; unset: derived from the degree and the schedule");
    v(pipeline_parallel_first_stage_less_layers, "pipeline_parallel_first_stage_less_layers",
      "layers fewer in the first stage, which also holds the embedding");
    v(pipeline_parallel_last_stage_less_layers, "pipeline_parallel_last_stage_less_layers",
      "layers fewer in the last stage, which also holds the output projection");
    v(pipeline_parallel_schedule, "pipeline_parallel_schedule", "schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV");
    v(pipeline_parallel_schedule_csv, "pipeline_parallel_schedule_csv", "schedule read from a CSV file");
    v(pipeline_parallel_microbatch_size, "pipeline_parallel_microbatch_size",
      "sequences per microbatch; local_batch_size must be a multiple");
    v(module_fqns_per_model_part, "module_fqns_per_model_part",
      "module names of each pipeline stage, e.g. [[\"tok_embeddings\", \"layers.0\"], [\"layers.1\", \"norm\", "
      "\"output\"]]; overrides the automatic split");
    v(context_parallel_degree, "context_parallel_degree", "ranks the sequence is split over; 1 disables");
    v(context_parallel_load_balancer, "context_parallel_load_balancer",
      "how sequences are cut over the cp ranks: headtail (chunks r and 2cp-1-r: equal causal-attention work) "
      "or none (contiguous); ptrr (per-document flex attention) is not supported",
      {"headtail", "none", "ptrr"});
    v(context_parallel_rotate_method, "context_parallel_rotate_method",
      "how ring attention moves key/value shards: allgather (all at once) or alltoall (one rank on per block, "
      "overlapping the computation)",
      {"allgather", "alltoall"});
    v(expert_parallel_degree, "expert_parallel_degree", "expert parallel degree of MoE models; 1 disables");
    v(expert_tensor_parallel_degree, "expert_tensor_parallel_degree",
      "tensor parallel degree inside MoE experts; 1 disables");
  }
  bool operator==(const Parallelism&) const = default;
};

struct Comm {
  int64_t init_timeout_seconds = 300;
  int64_t train_timeout_seconds = 100;
  int64_t trace_buf_size = 20000;
  std::string save_traces_folder = "comm_traces";
  std::string save_traces_file_prefix = "rank_";
  std::string mode = "default";

  template <class V>
  void visit(V& v) {
    v(init_timeout_seconds, "init_timeout_seconds", "collective timeout until the first step has finished");
    v(train_timeout_seconds, "train_timeout_seconds", "collective timeout after the first step");
    v(trace_buf_size, "trace_buf_size",
      "collectives each rank's flight recorder keeps (LibTorch's TORCH_FR_BUFFER_SIZE); > 0 also dumps them when an "
      "NCCL collective times out; 0 disables");
    v(save_traces_folder, "save_traces_folder", "flight recorder dumps, under job.dump_folder");
    v(save_traces_file_prefix, "save_traces_file_prefix", "flight recorder dump file name before the rank");
    v(mode, "mode", "communication backend mode", {"default", "fake_backend", "local_tensor"});
  }
  bool operator==(const Comm&) const = default;
};

struct FaultTolerance {
  bool enable = false;
  std::string process_group = "gloo";
  int64_t process_group_timeout_ms = 10000;
  int64_t replica_id = 0;
  int64_t group_size = 0;
  int64_t min_replica_size = 1;
  std::string semi_sync_method;

  template <class V>
  void visit(V& v) {
    v(enable, "enable", "fault-tolerant training with replica groups that may fail and rejoin");
    v(process_group, "process_group", "backend between replica groups", {"gloo", "nccl"});
    v(process_group_timeout_ms, "process_group_timeout_ms", "abort a replica-group collective after this long");
    v(replica_id, "replica_id", "index of this replica group");
    v(group_size, "group_size", "number of replica groups");
    v(min_replica_size, "min_replica_size", "replica groups needed to take a step");
    v(semi_sync_method, "semi_sync_method", "semi-synchronous method (local_sgd, diloco); empty: synchronous");
  }
  bool operator==(const FaultTolerance&) const = default;
};

struct Experimental {
  std::string custom_import;
  std::string custom_args_module;

  template <class V>
  void visit(V& v) {
    v(custom_import, "custom_import", "extra module that registers custom models or components");
    v(custom_args_module, "custom_args_module", "older spelling of job.custom_config_module");
  }
  bool operator==(const Experimental&) const = default;
};

struct Validation {
  bool enable = false;
  std::string dataset = "c4_validation";
  std::string dataset_path;
  std::string dataset_text_field = "text";
  int64_t local_batch_size = 8;
  int64_t seq_len = 2048;
  int64_t freq = 10;
  int64_t steps = -1;

  template <class V>
  void visit(V& v) {
    v(enable, "enable", "evaluate the loss on a validation set during training");
    v(dataset, "dataset", "validation dataset name");
    v(dataset_path, "dataset_path", "local path of the validation dataset");
    v(dataset_text_field, "dataset_text_field",
      "the field (JSON Lines) or column (Parquet, Arrow) holding each document's text");
    v(local_batch_size, "local_batch_size", "validation sequences per data-parallel rank");
    v(seq_len, "seq_len", "tokens per validation sequence");
    v(freq, "freq", "validate every this many training steps");
    v(steps, "steps", "validation batches per evaluation; -1 uses the whole set");
  }
  bool operator==(const Validation&) const = default;
};

struct Debug {
  std::optional<int64_t> seed;  // unset: the trainer's default seed
  bool deterministic = false;
  bool deterministic_warn_only = false;
  bool skip_memory_check = false;
  bool moe_force_load_balance = false;

  template <class V>
  void visit(V& v) {
    v(seed, "seed", "base random seed (initialization, data order); unset: the trainer's default seed");
    v(deterministic, "deterministic", "use deterministic kernels wherever they exist (slower)");
    v(deterministic_warn_only, "deterministic_warn_only", "with deterministic: warn instead of failing on ops without one");
    v(skip_memory_check, "skip_memory_check",
      "start even when titan estimate's per-rank peak exceeds the memory available to a rank (the pre-flight check)");
    v(moe_force_load_balance, "moe_force_load_balance",
      "route MoE tokens round-robin over the experts, whatever the router says (to measure speed under perfect "
      "balance; the model does not learn to route)");
  }
  bool operator==(const Debug&) const = default;
};

}  // namespace titan::config
