// Config sections about what is trained and how: [model], [optimizer], [lr_scheduler], [training],
// [checkpoint], [activation_checkpoint], [compile], [quantize.linear.float8].
//
// Each struct is one TOML table. A field's default is its member initializer; its TOML/CLI name and
// help text are given once in visit(), and that list drives parsing, --help and the dump (see
// field.h). Key names and defaults follow torchtitan's JobConfig (release v0.2.2); where titan's
// default differs, the help says why.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace titan::config {

struct Model {
  std::string name = "llama3";
  std::string flavor = "debugmodel";
  // torchtitan's default is its own test folder ./tests/assets/tokenizer; titan's lives in ./assets.
  std::string hf_assets_path = "./assets/tokenizer";
  std::vector<std::string> converters;
  bool print_after_conversion = false;
  std::optional<double> moe_aux_loss_coeff;  // unset: the flavor's (0 for torchtitan's flavors)

  template <class V>
  void visit(V& v) {
    v(name, "name", "model family to train, as registered in the model registry (e.g. llama3)");
    v(flavor, "flavor", "size preset of the model family (e.g. debugmodel, 8B, 70B, 405B), or the path of a Hugging Face config.json whose model to build");
    v(hf_assets_path, "hf_assets_path",
      "folder with Hugging Face assets: tokenizer files, config.json, *.safetensors weights");
    v(converters, "converters", "model transforms applied after building, e.g. quantize.linear.float8");
    v(print_after_conversion, "print_after_conversion", "print the module tree after the converters ran");
    v(moe_aux_loss_coeff, "moe_aux_loss_coeff",
      "mixture-of-experts models: coefficient of the auxiliary load-balancing loss (Qwen's global-batch form, "
      "docs/moe.md); unset: the flavor's (0, none, for the built-in flavors; router_aux_loss_coef for a "
      "Hugging Face config.json with output_router_logits)");
  }
  bool operator==(const Model&) const = default;
};

struct Optimizer {
  std::string name = "AdamW";
  double lr = 8e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  std::string implementation = "fused";
  bool early_step_in_backward = false;

  template <class V>
  void visit(V& v) {
    v(name, "name", "optimizer algorithm", {"AdamW", "Adam"});
    v(lr, "lr", "peak learning rate (reached at the end of warmup)");
    v(beta1, "beta1", "decay rate of the first-moment (mean) estimate");
    v(beta2, "beta2", "decay rate of the second-moment (variance) estimate");
    v(eps, "eps", "term added to the denominator for numerical stability");
    v(weight_decay, "weight_decay", "decoupled weight decay coefficient");
    v(implementation, "implementation",
      "kernel strategy of the update; all three compute the same update", {"for-loop", "foreach", "fused"});
    v(early_step_in_backward, "early_step_in_backward",
      "step each parameter as soon as its gradient is ready (frees gradients early; no clipping)");
  }
  bool operator==(const Optimizer&) const = default;
};

struct LRScheduler {
  int64_t warmup_steps = 200;
  std::optional<int64_t> total_steps;  // unset: training.steps
  std::optional<double> decay_ratio;   // unset: decay starts right after warmup
  std::string decay_type = "linear";
  double min_lr_factor = 0.0;

  template <class V>
  void visit(V& v) {
    v(warmup_steps, "warmup_steps", "steps of linear warmup from ~0 to optimizer.lr (clamped to the total steps)");
    v(total_steps, "total_steps", "steps the schedule spans; unset means training.steps");
    v(decay_ratio, "decay_ratio",
      "fraction of the steps spent decaying at the end (warmup-stable-decay); unset: decay right after warmup");
    v(decay_type, "decay_type", "shape of the decay", {"linear", "sqrt", "cosine"});
    v(min_lr_factor, "min_lr_factor", "the decay ends at optimizer.lr * min_lr_factor");
  }
  bool operator==(const LRScheduler&) const = default;
};

struct Training {
  std::string dataset = "c4_test";
  std::string dataset_path;  // empty: resolved from the dataset name
  std::vector<std::string> dataset_mix;  // "WEIGHT [NAME=]LOCATION [text_field=FIELD]" entries; non-empty replaces dataset/dataset_path
  std::string dataset_text_field = "text";
  int64_t local_batch_size = 8;
  int64_t global_batch_size = -1;
  int64_t seq_len = 2048;
  double max_norm = 1.0;
  int64_t steps = 10000;
  bool enable_cpu_offload = false;
  std::string dtype = "float32";
  std::string mixed_precision_param = "bfloat16";
  std::string mixed_precision_reduce = "float32";
  std::string nan_policy = "stop";

  template <class V>
  void visit(V& v) {
    v(dataset, "dataset", "dataset name (e.g. c4_test, c4)");
    v(dataset_path, "dataset_path", "local path of the dataset; empty: found from the dataset name");
    v(dataset_mix, "dataset_mix",
      "a weighted mixture of datasets instead of dataset/dataset_path: entries \"WEIGHT PATH\" or \"WEIGHT "
      "NAME=PATH\" (PATH: any dataset path, or c4_test / titan_corpus), a text source's own field or column "
      "after the path as \"text_field=FIELD\" (text_field=\"FIELD\" when it holds blanks); sample k comes from the source furthest behind its share, so the "
      "shares hold at every step");
    v(dataset_text_field, "dataset_text_field",
      "the field (JSON Lines) or column (Parquet, Arrow) holding each document's text");
    v(local_batch_size, "local_batch_size", "sequences per data-parallel rank per step");
    v(global_batch_size, "global_batch_size",
      "sequences per step over all ranks; -1 means local_batch_size * data-parallel degree");
    v(seq_len, "seq_len", "tokens per sequence");
    v(max_norm, "max_norm", "clip the global gradient norm to this value");
    v(steps, "steps", "number of optimizer steps to train");
    v(enable_cpu_offload, "enable_cpu_offload", "keep sharded parameters, gradients and optimizer states on the CPU");
    v(dtype, "dtype", "dtype of parameters, gradients and optimizer states", {"bfloat16", "float32"});
    v(mixed_precision_param, "mixed_precision_param", "compute dtype of parameters under mixed precision",
      {"bfloat16", "float32"});
    v(mixed_precision_reduce, "mixed_precision_reduce", "dtype of gradient reductions under mixed precision",
      {"float32"});
    v(nan_policy, "nan_policy",
      "a step whose loss or gradient norm is NaN or infinite never updates the model; stop: the run ends "
      "there with an error (the last checkpoint stays intact); skip: training goes on with the next batch",
      {"stop", "skip"});
  }
  bool operator==(const Training&) const = default;
};

struct Checkpoint {
  bool enable = false;
  std::string folder = "checkpoint";
  int64_t interval = 500;
  std::string initial_load_path;  // empty: none
  bool initial_load_model_only = true;
  bool initial_load_in_hf = false;
  bool last_save_model_only = true;
  bool last_save_in_hf = false;
  std::string export_dtype = "float32";
  std::string async_mode = "disabled";
  int64_t keep_latest_k = 10;
  int64_t load_step = -1;
  std::vector<std::string> exclude_from_loading;
  bool enable_first_step_checkpoint = false;
  bool create_seed_checkpoint = false;
  bool load_only = false;
  int64_t save_timeout_seconds = 600;

  template <class V>
  void visit(V& v) {
    v(enable, "enable", "save checkpoints and resume from the latest one");
    v(folder, "folder", "checkpoint folder, relative to job.dump_folder; holds step-N subfolders");
    v(interval, "interval", "save every this many steps");
    v(initial_load_path, "initial_load_path", "checkpoint to start from when the folder holds none");
    v(initial_load_model_only, "initial_load_model_only", "load only the model from initial_load_path");
    v(initial_load_in_hf, "initial_load_in_hf", "initial_load_path is in Hugging Face safetensors format");
    v(last_save_model_only, "last_save_model_only", "the save after the last step keeps only the model");
    v(last_save_in_hf, "last_save_in_hf", "write the last save in Hugging Face safetensors format");
    v(export_dtype, "export_dtype", "dtype of a model-only last save", {"float16", "bfloat16", "float32"});
    v(async_mode, "async_mode", "write checkpoints in the background", {"disabled", "async", "async_with_pinned_mem"});
    v(keep_latest_k, "keep_latest_k", "keep only the newest k checkpoints; 0 keeps all (1 is not allowed)");
    v(load_step, "load_step", "step to resume from; -1 means the latest");
    v(exclude_from_loading, "exclude_from_loading", "parts not to load, e.g. optimizer,lr_scheduler,dataloader");
    v(enable_first_step_checkpoint, "enable_first_step_checkpoint", "also save right after the first step");
    v(create_seed_checkpoint, "create_seed_checkpoint", "write the initialized model as step-0 and exit");
    v(load_only, "load_only", "load checkpoints but never save");
    v(save_timeout_seconds, "save_timeout_seconds",
      "how long a rank waits for the others to finish writing a save (a dead rank is noticed at once)");
  }
  bool operator==(const Checkpoint&) const = default;
};

struct ActivationCheckpoint {
  std::string mode = "selective";
  std::string selective_ac_option = "2";
  double memory_budget = 0.5;
  std::string per_op_policy = "every_other_matmul";
  std::vector<std::string> per_op_sac_force_recompute_mm_shapes_by_fqns = {"moe.router.gate"};
  std::string determinism_check = "default";

  template <class V>
  void visit(V& v) {
    v(mode, "mode", "which activations to recompute in backward", {"selective", "full", "memory_budget", "none"});
    v(selective_ac_option, "selective_ac_option",
      "selective mode: an integer n checkpoints every n-th layer; 'op' selects by operator");
    v(per_op_policy, "per_op_policy",
      "selective_ac_option 'op': every_other_matmul keeps attention and every other matmul's output "
      "(torchtitan's policy); all_matmuls keeps every matmul's (more memory, less recomputation)",
      {"every_other_matmul", "all_matmuls"});
    v(memory_budget, "memory_budget", "memory_budget mode: 0 recomputes most, 1 recomputes least");
    v(per_op_sac_force_recompute_mm_shapes_by_fqns, "per_op_sac_force_recompute_mm_shapes_by_fqns",
      "per-operator checkpointing (selective_ac_option 'op', and memory_budget's per-operator blocks): Linear "
      "layers whose name contains one of these are always recomputed and not counted by the every-other-matmul "
      "policy");
    v(determinism_check, "determinism_check",
      "default: a recomputed block must give an output of the forward's shape, dtype and device (else an error "
      "naming the block); none: no check",
      {"default", "none"});
  }
  bool operator==(const ActivationCheckpoint&) const = default;
};

struct Compile {
  bool enable = false;
  std::vector<std::string> components = {"model", "loss"};
  std::string backend = "inductor";

  template <class V>
  void visit(V& v) {
    v(enable, "enable", "compile the components listed below");
    v(components, "components", "what to compile: model, loss");
    v(backend, "backend", "compiler backend");
  }
  bool operator==(const Compile&) const = default;
};

// TOML table [quantize.linear.float8]; older configs spell it [float8].
struct Float8Linear {
  bool enable_fsdp_float8_all_gather = false;
  bool precompute_float8_dynamic_scale_for_fsdp = false;
  std::string recipe_name;  // empty: tensorwise scaling
  std::vector<std::string> filter_fqns;
  bool emulate = false;

  template <class V>
  void visit(V& v) {
    v(enable_fsdp_float8_all_gather, "enable_fsdp_float8_all_gather",
      "FSDP all-gathers float8 layers' weights in float8 (tensorwise recipe)");
    v(precompute_float8_dynamic_scale_for_fsdp, "precompute_float8_dynamic_scale_for_fsdp",
      "the float8 all-gather's scales from one all-reduce after each optimizer step");
    v(recipe_name, "recipe_name", "scaling recipe; empty means tensorwise",
      {"", "tensorwise", "rowwise", "rowwise_with_gw_hp"});
    v(filter_fqns, "filter_fqns", "modules (by name) kept in high precision, e.g. output");
    v(emulate, "emulate", "emulate float8 matmuls (for testing on GPUs without float8)");
  }
  bool operator==(const Float8Linear&) const = default;
};

// TOML table [quantize.grouped_mm.float8]: the MoE experts converted by "quantize.grouped_mm.float8".
struct Float8GroupedMM {
  std::vector<std::string> fqns;

  template <class V>
  void visit(V& v) {
    v(fqns, "fqns", "MoE modules (by name, e.g. experts) whose grouped matmuls run in float8");
  }
  bool operator==(const Float8GroupedMM&) const = default;
};

}  // namespace titan::config
