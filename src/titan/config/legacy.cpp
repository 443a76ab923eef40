#include "titan/config/legacy.h"

#include "titan/config/field.h"

namespace titan::config {

namespace {

constexpr const char* kInProcessLoader =
    "titan reads and tokenizes its data in C++ inside the training process (no Python worker processes to start, "
    "keep or prefetch with)";
constexpr const char* kPinned = "on CUDA titan always copies batches to the GPU from pinned memory, asynchronously";
constexpr const char* kEstimate =
    "read by torchtitan's separate memory-estimation script; titan's is `titan estimate` (a dry run of the step "
    "on the meta device)";
constexpr const char* kFaultTolerance =
    "used only by fault-tolerant training (fault_tolerance.enable), which titan does not support";

}  // namespace

const std::vector<LegacyKey>& legacy_keys() {
  using K = LegacyKind;
  static const std::vector<LegacyKey> keys = {
      {"job", "use_for_integration_test", K::NoEffect, "bool", "marks a config for torchtitan's own test suite"},
      {"job", "print_args", K::Rename, "job.print_config", ""},
      {"metrics", "enable_color_printing", K::Negate, "metrics.disable_color_printing", ""},
      {"metrics", "rank_0_only", K::Negate, "metrics.save_for_all_ranks", ""},
      {"model", "tokenizer_path", K::Rename, "model.hf_assets_path",
       "a tokenizer file or a folder holding one"},
      {"model", "norm_type", K::FixedValue, "rmsnorm|fused_rmsnorm|compiled_rmsnorm",
       "Llama 3 uses RMSNorm; fused_rmsnorm and compiled_rmsnorm named torchtitan's kernels for it, and titan "
       "picks its own"},
      {"lr_scheduler", "lr_min", K::Rename, "lr_scheduler.min_lr_factor", ""},
      {"training", "batch_size", K::Rename, "training.local_batch_size", ""},
      {"training", "warmup_steps", K::Rename, "lr_scheduler.warmup_steps", ""},
      {"training", "data_parallel_replicate_degree", K::Rename, "parallelism.data_parallel_replicate_degree", ""},
      {"training", "data_parallel_shard_degree", K::Rename, "parallelism.data_parallel_shard_degree", ""},
      {"training", "tensor_parallel_degree", K::Rename, "parallelism.tensor_parallel_degree", ""},
      {"training", "context_parallel_degree", K::Rename, "parallelism.context_parallel_degree", ""},
      {"training", "enable_async_tensor_parallel", K::Rename, "parallelism.enable_async_tensor_parallel", ""},
      {"training", "enable_loss_parallel", K::Negate, "parallelism.disable_loss_parallel", ""},
      {"training", "compile", K::Rename, "compile.enable", ""},
      {"training", "enable_float8_linear", K::Float8Switch, "model.converters", ""},
      {"training", "seed", K::Rename, "debug.seed", ""},
      {"training", "deterministic", K::Rename, "debug.deterministic", ""},
      {"training", "gc_freq", K::NoEffect, "int", "Python garbage-collection interval; titan has no garbage collector"},
      {"training", "gc_debug", K::NoEffect, "bool", "Python garbage-collection debugging; titan has no garbage collector"},
      {"experimental", "pipeline_parallel_degree", K::Rename, "parallelism.pipeline_parallel_degree", ""},
      {"experimental", "pipeline_parallel_split_points", K::Rename, "parallelism.pipeline_parallel_split_points", ""},
      {"experimental", "pipeline_parallel_schedule", K::Rename, "parallelism.pipeline_parallel_schedule", ""},
      {"experimental", "pipeline_parallel_schedule_csv", K::Rename, "parallelism.pipeline_parallel_schedule_csv", ""},
      {"experimental", "pipeline_parallel_microbatch_size", K::Rename,
       "parallelism.pipeline_parallel_microbatch_size", ""},
      {"experimental", "context_parallel_degree", K::Rename, "parallelism.context_parallel_degree", ""},
      {"experimental", "enable_async_tensor_parallel", K::Rename, "parallelism.enable_async_tensor_parallel", ""},
      {"checkpoint", "enable_checkpoint", K::Rename, "checkpoint.enable", ""},
      {"checkpoint", "model_weights_only", K::Rename, "checkpoint.last_save_model_only", ""},
      {"checkpoint", "last_save_model_weights_only", K::Rename, "checkpoint.last_save_model_only", ""},
      {"checkpoint", "initial_load_model_weights_only", K::Rename, "checkpoint.initial_load_model_only", ""},
      {"training", "data_parallel_degree", K::Rename, "parallelism.data_parallel_shard_degree", ""},
      {"profiling", "run_profiler", K::Rename, "profiling.enable_profiling", ""},
      {"profiling", "profile_every_x_iter", K::Rename, "profiling.profile_freq", ""},
      {"validation", "enabled", K::Rename, "validation.enable", ""},
      {"parallelism", "enable_compiled_autograd", K::OffOnly, "",
       "compiled autograd is part of torch.compile, which titan does not have (compile.enable is refused too)"},
      {"experimental", "enable_compiled_autograd", K::OffOnly, "",
       "compiled autograd is part of torch.compile, which titan does not have (compile.enable is refused too)"},
      {"training", "debug_moe_force_load_balance", K::Rename, "debug.moe_force_load_balance", ""},
      {"activation_checkpoint", "preserve_rng_state", K::NoEffect, "bool",
       "the recomputed blocks draw no random numbers (the models have no dropout)"},
      {"checkpoint", "interval_type", K::FixedValue, "steps", "checkpoint intervals are counted in steps"},
      {"float8", "enable_float8_linear", K::Float8Switch, "model.converters", ""},
      {"float8", "enable_fsdp_float8_all_gather", K::Rename, "quantize.linear.float8.enable_fsdp_float8_all_gather", ""},
      {"float8", "precompute_float8_dynamic_scale_for_fsdp", K::Rename,
       "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", ""},
      {"float8", "recipe_name", K::Rename, "quantize.linear.float8.recipe_name", ""},
      {"float8", "filter_fqns", K::Rename, "quantize.linear.float8.filter_fqns", ""},
      {"float8", "emulate", K::Rename, "quantize.linear.float8.emulate", ""},
      {"float8", "force_recompute_fp8_weight_in_bwd", K::NoEffect, "bool",
       "titan's float8 layers always cast the weight again in backward (they save the weight, not its float8 "
       "copy), which is what true asks for"},
      {"float8", "moe_fqns", K::EmptyOnly, "",
       "float8 MoE experts are converted by the \"quantize.grouped_mm.float8\" converter: add it to model.converters "
       "and name the experts in quantize.grouped_mm.float8.fqns"},
      {"float8", "moe_fqns_prototype", K::EmptyOnly, "",
       "float8 MoE experts are converted by the \"quantize.grouped_mm.float8\" converter: add it to model.converters "
       "and name the experts in quantize.grouped_mm.float8.fqns"},
      // torchtitan 0.2's keys (and its fault-tolerance extension's and development versions') for what
      // titan has in another form or not at all.
      {"training.dataloader", "num_workers", K::NoEffect, "int", kInProcessLoader},
      {"training.dataloader", "persistent_workers", K::NoEffect, "bool", kInProcessLoader},
      {"training.dataloader", "prefetch_factor", K::NoEffect, "int", kInProcessLoader},
      {"training.dataloader", "pin_memory", K::NoEffect, "bool", kPinned},
      {"validation.dataloader", "num_workers", K::NoEffect, "int", kInProcessLoader},
      {"validation.dataloader", "persistent_workers", K::NoEffect, "bool", kInProcessLoader},
      {"validation.dataloader", "prefetch_factor", K::NoEffect, "int", kInProcessLoader},
      {"validation.dataloader", "pin_memory", K::NoEffect, "bool", kPinned},
      {"memory_estimation", "enable", K::NoEffect, "bool", kEstimate},
      {"memory_estimation", "enabled", K::NoEffect, "bool", kEstimate},
      {"memory_estimation", "disable_fake_mode", K::NoEffect, "bool", kEstimate},
      {"activation_checkpoint", "early_stop", K::OffOnly, "",
       "titan's recomputation runs a checkpointed block's whole body (less the operations a per-operator policy "
       "kept); it does not stop once the saved tensors are rematerialized"},
      {"activation_checkpoint", "debug", K::OffOnly, "",
       "torch.utils.checkpoint's debug capture of the recomputed operators does not exist in titan"},
      {"activation_checkpoint", "visualize_memory_budget_pareto", K::OffOnly, "",
       "the memory-budget trade-off plot belongs to torch.compile's min-cut partitioner; titan's mode = "
       "\"memory_budget\" chooses among per-block modes instead, and `titan estimate` prints the peak it gives"},
      {"checkpoint", "initial_load_in_hf_quantized", K::OffOnly, "",
       "reading Hugging Face checkpoints with quantized weights (dequantized on load) is not supported; "
       "convert them to bf16 or fp32 safetensors first"},
      {"checkpoint", "enable_ft_dataloader_checkpoints", K::NoEffect, "bool", kFaultTolerance},
      {"fault_tolerance", "sync_steps", K::NoEffect, "int", kFaultTolerance},
      {"fault_tolerance", "should_quantize", K::NoEffect, "bool", kFaultTolerance},
      {"fault_tolerance", "fragment_sync_delay", K::NoEffect, "int", kFaultTolerance},
      {"fault_tolerance", "fragment_update_alpha", K::NoEffect, "float", kFaultTolerance},
      {"parallelism", "expert_parallel_comm_backend", K::FixedValue, "standard",
       "titan's expert parallelism exchanges tokens with all-to-all collectives; DeepEP's kernels are not supported"},
      {"parallelism", "pipeline_parallel_expert_parallel_overlap", K::NoEffect, "bool",
       "titan runs each of DualPipeV's forward/backward pairs one after the other, so there is no expert-parallel "
       "communication to overlap with the other half"},
      {"liger_kernel", "enable_fused_linear_cross_entropy", K::OffOnly, "",
       "Liger's fused linear + cross-entropy kernel is not supported"},
  };
  return keys;
}

const LegacyKey* find_legacy(std::string_view section, std::string_view key) {
  for (const auto& k : legacy_keys())
    if (section == k.section && key == k.key) return &k;
  return nullptr;
}

bool is_legacy_section(std::string_view section) {
  for (const auto& s : sections())
    if (s.name == section) return false;
  for (const auto& k : legacy_keys())
    if (section == k.section) return true;
  return false;
}

const char* unsupported_reason(std::string_view path) {
  static constexpr const char* kMx =
      "the MX formats (torchtitan's block-scaled mxfp8 and mxfp4 matmuls, which need Blackwell GPUs) are not "
      "supported: use quantize.linear.float8 (and quantize.grouped_mm.float8 for experts) instead";
  for (std::string_view table : {"quantize.linear.mx", "quantize.grouped_mm.mx", "mx"})
    if (path == table || (path.size() > table.size() && path.substr(0, table.size()) == table &&
                          path[table.size()] == '.'))
      return kMx;
  return nullptr;
}

}  // namespace titan::config
