// Model registry: a model name maps to a ModelSpec that says how to build each flavor, how to
// translate its weights to and from Hugging Face, and (once those parallelisms exist) how to
// parallelize and pipeline it. The trainer and the CLI only ever go through this table, so a new
// model plugs in by registering a spec, without touching them.
#pragma once

#include "titan/config/sections_train.h"
#include "titan/models/model.h"

#include <ATen/core/Tensor.h>
#include <torch/nn/pimpl.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace titan {

namespace dist {
class DataParallel;
class TensorParallel;
class ContextParallel;
class ExpertParallel;
}

// What the trainer hands a model's parallelize function: the parallelisms to apply.
struct ParallelizeContext {
  // FSDP, HSDP, DDP or none (required): the plan adds its units (inner first, the root last) and
  // the placements other parallelisms gave parameters, then calls finish (see data_parallel.h).
  dist::DataParallel* data_parallel = nullptr;
  // Tensor (and sequence) parallelism over the tp mesh dimension; null when the degree is 1.
  dist::TensorParallel* tensor_parallel = nullptr;
  // Context parallelism over the cp mesh dimension (the model's input holds the rank's part of every
  // sequence; attention becomes ring attention); null when the degree is 1.
  dist::ContextParallel* context_parallel = nullptr;
  // Expert parallelism over the ep mesh dimension (MoE layers' experts split, tokens exchanged by
  // all-to-all); null when the degree is 1. Needs data_parallel built with the efsdp group.
  dist::ExpertParallel* expert_parallel = nullptr;
  // Activation checkpointing of the repeated blocks: "none", "full" (every block), "selective"
  // (every ac_every-th block, counting from 1, as torchtitan's selective_ac_option k does), "op"
  // (every block, keeping attention's output and log-sum-exp and every other matmul's output:
  // selective_ac_option "op", torchtitan's policy) or "op_all_matmuls" (every matmul's output too).
  // "per_block": block i (its layer id) takes ac_block_modes[i], one of none, full, op, op_all_matmuls
  // (activation_checkpoint.mode "memory_budget", resolved into it by titan estimate's dry runs;
  // set_activation_checkpointing leaves ac_mode "memory_budget" for the caller to resolve).
  std::string ac_mode = "none";
  int64_t ac_every = 1;
  std::vector<std::string> ac_block_modes;
  // Under "op" / "op_all_matmuls": Linear layers of a block whose name contains one of these are
  // recomputed, never kept, and not counted by the every-other policy (torchtitan's
  // per_op_sac_force_recompute_mm_shapes_by_fqns).
  std::vector<std::string> ac_force_recompute;
  // Whether a recomputed block's output is checked against the forward's (determinism_check).
  bool ac_check_recompute = true;
};

// The [activation_checkpoint] section as ac_mode / ac_every.
void set_activation_checkpointing(ParallelizeContext& ctx, const config::ActivationCheckpoint& section);

// What a model's parallelize function hands back to the training step.
struct ParallelizedModel {
  // Sum over tokens of the cross-entropy of the model's logits (flattened to (N, V) or, under loss
  // parallel, the rank's vocabulary slice (N, V/tp)) for labels (N).
  std::function<at::Tensor(const at::Tensor& logits, const at::Tensor& labels)> loss_sum;
};

using LanguageModel = std::shared_ptr<LanguageModelImpl>;
using StateDict = std::map<std::string, at::Tensor>;

// Converts state dicts between titan's native names/layouts and Hugging Face transformers' ones.
struct HFAdapter {
  std::function<StateDict(const StateDict&)> to_hf;
  std::function<StateDict(const StateDict&)> from_hf;
  // The flavor's config.json for transformers, declaring weights stored in `dtype`.
  std::function<std::string(at::ScalarType dtype)> config_json;
  // Why a config.json's text does not describe this flavor ("hidden_size is 128, the flavor has
  // 256"), naming the first field that differs; "" when it matches. Throws UserError for malformed JSON.
  std::function<std::string(const std::string& config_json)> config_mismatch;
  // HF tensors written in fp32 whatever the export dtype (a MoE router's gate and routing bias, which
  // transformers keeps in fp32: rounding them can flip near-tied routing choices); null: none.
  std::function<bool(const std::string& hf_name)> keep_fp32;
};

struct ModelSpec {
  std::string name;
  std::vector<std::string> flavors;
  // Builds the flavor with parameters created by `opts` (device meta: shapes only, no memory).
  // Parameters are uninitialized until init_weights(seed) is called. max_seq_len bounds RoPE.
  std::function<LanguageModel(const std::string& flavor, const at::TensorOptions& opts, int64_t max_seq_len)> build;
  // Builds the modules `modules` of the flavor under their global names: one pipeline stage (names
  // as pipeline_split gives them; see LanguageModelImpl::forward for its input and output).
  std::function<LanguageModel(const std::string& flavor, const at::TensorOptions& opts, int64_t max_seq_len,
                              const std::vector<std::string>& modules)>
      build_stage;
  // Applies the parallelisms of `ctx` to a built model (from outside: the model code does not
  // change); parameters built without storage get their values from the data-parallel layer. torchtitan's order: TP, CP, activation checkpointing, then FSDP.
  std::function<ParallelizedModel(LanguageModelImpl& model, const ParallelizeContext& ctx)> parallelize;
  // Module names of each pipeline stage for a flavor, given the number of stages and the layer
  // weights of the embedding and the output (see pipeline_split.h).
  std::function<std::vector<std::vector<std::string>>(const std::string& flavor, int64_t num_stages,
                                                      int64_t input_weight, int64_t output_weight)>
      pipeline_split;
  // HF adapter for a flavor (HF layouts depend on shapes, e.g. heads for the RoPE permutation).
  std::function<HFAdapter(const std::string& flavor)> hf_adapter;
  // The flavor as a checkpoint records it: a name unchanged; a flavor read from a file (a Hugging
  // Face config.json) as the model's arguments themselves, which every function here accepts as a
  // flavor, so that the checkpoint does not depend on the file.
  std::function<std::string(const std::string& flavor)> flavor_record;
};

// Registers a spec (called once per model at start-up); a second spec with the same name is an error.
void register_model(ModelSpec spec);
// The spec for `name`, or a UserError listing the registered models.
const ModelSpec& model_spec(const std::string& name);
std::vector<std::string> registered_models();

}  // namespace titan
