// The trainer: builds everything a run needs from a JobConfig and the model registry, then trains.
// Read top to bottom: Trainer() sets the run up, train() is the loop, train_step() one step.
#pragma once

#include "titan/components/checkpoint/checkpoint.h"
#include "titan/components/checkpoint/checkpointer.h"
#include "titan/components/data/dataloader.h"
#include "titan/components/metrics/metrics.h"
#include "titan/components/metrics/profiler.h"
#include "titan/components/optimizer/lr_scheduler.h"
#include "titan/components/optimizer/optimizer.h"
#include "titan/components/quantization/float8_converter.h"
#include "titan/common/folder_lock.h"
#include "titan/common/preemption.h"
#include "titan/components/tokenizer/tokenizer.h"
#include "titan/config/job_config.h"
#include "titan/distributed/context_parallel.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/expert_parallel.h"
#include "titan/distributed/mesh.h"
#include "titan/distributed/pipeline.h"
#include "titan/distributed/placement.h"
#include "titan/distributed/runtime.h"
#include "titan/distributed/tensor_parallel.h"
#include "titan/models/registry.h"

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>

#include <array>
#include <map>
#include <functional>
#include <string>
#include <memory>
#include <vector>

namespace titan {

// Where a run ran out of memory: while the model is built, initialized or loaded; in a training step;
// or in the evaluation of the validation data. Each has its own advice.
enum class OutOfMemoryAt { StartUp, Step, Validation };

// What one optimizer step produced (the loss is averaged over every token of the global batch).
struct StepResult {
  double loss = 0;      // global average over the data-parallel ranks
  double max_loss = 0;  // largest local average loss among the data-parallel ranks
  double grad_norm = 0;
  double lr = 0;
  bool skipped = false;  // the loss or gradient norm was not finite: the model was not updated
  // MoE models: this rank's layers' load imbalances (busiest expert / mean): sum, layers, largest;
  // then the sum of its layers' auxiliary-loss terms (0 without the auxiliary loss).
  std::array<double, 4> moe_load = {0, 0, 0, 0};
};

class Trainer {
 public:
  // Builds tokenizer, model, optimizer, schedule, data loader and metrics. Throws UserError for a
  // config that cannot run here (unsupported features, missing files, mismatched tokenizer).
  // `preflight` (titan train's memory check) runs on every rank after the cheap checks, before the
  // tokenizer and the model; if it throws on any rank, every rank throws.
  explicit Trainer(JobConfig cfg, const std::function<void()>& preflight = {});

  // Runs training.steps steps, logging every metrics.log_freq steps. Returns the per-step losses.
  std::vector<double> train();

  // Called by train() after each step (its log line and checkpoint save issued), with the step.
  void set_step_callback(std::function<void(int64_t)> callback) { step_callback_ = std::move(callback); }

  // One optimizer step over gradient_accumulation_steps() micro-batches of local_batch_size, its
  // results read on the host (train() reads them only at log steps, see StepOnDevice).
  StepResult train_step();
  // aten::_local_scalar_dense calls (host reads of device values: .item(), a bool of a tensor) made
  // during train()'s steps that read nothing (not a log, save, validation or final step); counted
  // only with TITAN_DEBUG_DUMP_COMM set (written there as "host_reads_outside_log_steps"), else -1.
  int64_t host_reads_outside_log_steps() const { return host_reads_outside_log_steps_; }

  // ---- validation (trainer_validate.cpp): with validation.enable, train() evaluates at step 1 and
  // every validation.freq steps. Evaluates the loss on validation.steps batches of the validation set
  // (all of one pass with -1), the same batches every time, without gradients; collective over all
  // ranks. Returns the average loss over every validation token of all data-parallel ranks.
  metrics::ValidationStats validate();
  bool validation_enabled() const { return val_loader_ != nullptr; }

  int64_t step() const { return step_; }
  const dist::LaunchEnv& launch_env() const { return env_; }
  // The full, unsharded parameters (fp32, CPU) by name; collective over the shard groups.
  std::map<std::string, at::Tensor> full_parameters();
  // The parameters this rank holds (shards under FSDP), with their placements.
  const std::vector<dist::PlacedTensor>& parameters() const { return params_; }
  int64_t tokens_seen() const { return ntokens_seen_ * dims_->dp_size(); }  // all ranks together

  // ---- checkpoints (trainer_checkpoint.cpp; format in components/checkpoint)
  // Saves the training state as step step(); with model_only just the model, its floats cast to
  // export_dtype when given (the last save with checkpoint.last_save_model_only; a seed checkpoint is fp32).
  void save_checkpoint(bool model_only, std::optional<at::ScalarType> export_dtype = std::nullopt);
  // Waits for a background save to finish (rethrowing its failure).
  void wait_for_checkpoint();
  int64_t gradient_accumulation_steps() const { return grad_accum_steps_; }
  // The whole model (without pipeline parallelism it holds the parameters; with it, only their
  // shapes: this rank's stages hold them).
  const LanguageModel& model() const { return model_; }
  const dist::PipelineRunner* pipeline() const { return pipeline_.get(); }  // null without pipeline parallelism
  const c10::Device& device() const { return device_; }

 private:
  void log_info(const std::string& msg) const;     // rank 0 only
  void log_warning(const std::string& msg) const;  // rank 0 only, at WARNING level on stderr
  // "Restart N: " in a job restarted after a failure (TORCHELASTIC_RESTART_COUNT = N > 0), else "".
  std::string restart_note() const;
  void set_up_distributed();
  void set_up_checkpointing();
  // UserError when a titan checkpoint of this model family records other model arguments.
  std::string dcp_optimizer_note(const std::map<std::string, double>& saved) const;
  void check_checkpoint_model(const checkpoint::Reader& reader) const;
  void set_up_validation();  // the validation data loader (checked at start-up), when enabled
  // The next batch of the training data on the device (the data fault point, its trace range and
  // the time it took counted in the data-loading figure); under context parallelism, this rank's
  // part of every sequence.
  data::Batch next_batch(int64_t step);
  // A batch's tensors on the training device; on CUDA from pinned memory, asynchronously.
  void to_device(data::Batch& batch) const;
  // Pipeline parallelism (trainer_pipeline.cpp): splits the model into stages, builds and
  // parallelizes this rank's (each with its own data-parallel layer, made by make_dp) and the
  // schedule's runner.
  void set_up_pipeline(const ModelSpec& spec, ParallelizeContext pctx,
                       const std::function<std::unique_ptr<dist::DataParallel>()>& make_dp,
                       const at::TensorOptions& param_options, int64_t max_seq_len, at::ScalarType boundary_dtype);
  // One step's forwards and backwards over its gradient_accumulation_steps() micro-batches: the sum
  // of their losses (each already divided by global_tokens).
  at::Tensor forward_backward(int64_t step, double global_tokens);
  // A micro-batch's loss: the sum over its tokens divided by the global batch's tokens (with the
  // loss fault point and an injected NaN).
  at::Tensor loss_of(const at::Tensor& logits_BSV, const at::Tensor& labels_BS, int64_t step, double global_tokens);
  // One step's forwards and backwards through the pipeline (forward_backward under PP):
  // the sum of this rank's losses (those of the last stage; 0 on other ranks).
  at::Tensor pipeline_forward_backward(int64_t step, double global_tokens);
  // The validation loss sum of one batch through the pipeline (0 on ranks without the last stage).
  at::Tensor pipeline_evaluate(const at::Tensor& inputs_BS, const at::Tensor& labels_BS);
  // Calls f(name, full tensor) for every parameter of the model in the model's order: gathered over
  // its shard groups and, under pipeline parallelism, sent from its stage's ranks to every pp rank
  // (fp32, on the mesh's device). Collective over all ranks.
  void for_each_full_parameter(const std::function<void(const std::string&, const at::Tensor&)>& f);
  // After a step whose loss or gradient norm was not finite: a warning (nan_policy skip) or the error
  // that ends the run (stop), once a background save of an earlier step has completed.
  void on_nonfinite_step(const StepResult& r, int64_t step);
  // One step's results while they are still on the device: no host synchronization inside a step.
  struct StepOnDevice {
    double lr = 0;
    // fp64 (4): loss, max_loss, grad_norm, and 1 where the update was skipped; (8) for MoE models,
    // then StepResult::moe_load
    at::Tensor values;
  };
  StepOnDevice run_step();
  // Reads the results of `steps` with one device-to-host copy.
  std::vector<StepResult> read_steps(const std::vector<StepOnDevice>& steps);
  // After an out-of-memory error in a step: writes the memory snapshot (when configured) and throws
  // the UserError that names the step, the snapshot and what to change.
  [[noreturn]] void throw_out_of_memory(const c10::OutOfMemoryError& e, int64_t step,
                                       OutOfMemoryAt where = OutOfMemoryAt::Step);
  // ---- preemption (job.preemption_signals): whether any rank received a preemption signal, as the
  // ranks agree by a MAX reduction over the host groups "preemption_node(s)" (Gloo, beside training,
  // in two levels: Mesh::host_groups_by_block), in a thread of its own. Called on
  // every rank once per step: returns the signal found by the vote issued at the previous call
  // (0: none), then issues the next one, so that the vote never waits on the step in flight. With
  // `blocking` (before the first step) the vote issued now is also the one read.
  int preemption_vote(bool blocking, bool issue_next);
  // Ends the run after the agreed step: its checkpoint saved (with checkpoint.enable), a log line
  // naming it, then Preempted (exit code kExitPreempted). `saved_now`: this step's save was issued.
  [[noreturn]] void stop_for_preemption(int sig, bool saved_now);
  // ---- start-up, in the constructor's order
  void set_up_process();  // the dump folder's lock, preemption, processes and mesh, the first log lines, seed
  std::string saved_config_path() const;
  // The tokenization of text data shared by this node's ranks, over host group `name`.
  data::TokenizeTogether tokenize_together(const std::string& name);
  std::vector<dist::Group*> data_groups_;  // the host groups of those exchanges
  uint64_t seed() const;
  struct Precision {
    at::ScalarType param_dtype = at::kFloat;
    bool bf16_compute = false;  // CUDA and mixed_precision_param bfloat16
    bool use_fsdp = false;      // FSDP (or CPU offload, which shards with it)
  };
  Precision resolve_precision();
  void check_before_build();
  void check_float8_on_cuda();
  dist::DataParallelOptions apply_parallelisms(const ModelSpec& spec, const Precision& precision, int64_t max_seq_len);
  std::vector<std::pair<std::string, at::Tensor>> collect_parameters();
  void log_run(double model_seconds, int64_t global_batch, bool float8_all_gather, int64_t float8_gathered);
  void save_checkpoint_at_step();  // the periodic save, or the last one (model only / Hugging Face)  // the checkpointer, then the resume (or initial load) if there is one
  // The tensors of a checkpoint by checkpoint name: "model.<param>", "optimizer.<param>.exp_avg", ...
  // saving: without the copies of shared parameters that another rank writes (is_shared_copy).
  std::vector<dist::PlacedTensor> checkpoint_tensors(const std::vector<std::string>& parts, bool saving);
  nlohmann::json checkpoint_state();
  // Runs `f` on every rank; if it throws on any, every rank throws (the failing rank its own error,
  // the others one naming `what`), so that no rank waits for another in a collective.
  void on_every_rank(const std::function<void()>& f, const std::string& what);
  // Loads `parts` from `source` (all ranks agree on success before anything is modified).
  void load_checkpoint(checkpoint::Source& source, std::vector<std::string> parts, const nlohmann::json& state,
                       bool allow_cast);

  JobConfig cfg_;
  dist::LaunchEnv env_;
  std::unique_ptr<FolderLock> dump_lock_;  // rank 0: one run per job.dump_folder
  std::unique_ptr<PreemptionHandler> preemption_;  // null when job.preemption_signals is empty
  std::unique_ptr<dist::ParallelDims> dims_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::unique_ptr<dist::Mesh> mesh_;
  // The preemption vote in flight (after mesh_: a vote still running when the trainer ends normally
  // is waited for before the groups go).
  std::shared_ptr<class PreemptionVoter> preemption_voter_;
  // FSDP, HSDP, DDP or none: one for the model, or one per pipeline stage this rank holds.
  std::vector<std::unique_ptr<dist::DataParallel>> data_parallel_;
  std::unique_ptr<dist::TensorParallel> tensor_parallel_;  // null when tp is 1
  std::unique_ptr<dist::ContextParallel> context_parallel_;  // null when cp is 1
  std::unique_ptr<dist::ExpertParallel> expert_parallel_;    // null when ep is 1
  ParallelizedModel parallelized_;
  c10::Device device_{c10::kCPU};
  bool bf16_autocast_ = false;
  std::unique_ptr<Tokenizer> tokenizer_;
  LanguageModel model_;
  // ---- pipeline parallelism (empty / null without it)
  std::vector<LanguageModel> stage_models_;
  std::vector<std::vector<std::string>> stage_modules_;  // every stage's modules
  std::unique_ptr<dist::PipelineRunner> pipeline_;
  int64_t pipeline_seq_len_ = 0;  // the attended sequence's length (the rank's CP part) in the running step or evaluation
  // Parameters another stage on another pipeline rank also holds (a tied embedding table): their
  // gradients are exchanged with that rank and summed after backward (sum_shared_gradients).
  struct SharedGradient {
    std::string name;
    bool primary = true;  // the copy checkpoints write and the gradient norm counts
    int peer = -1;        // the pipeline rank holding the other copy
    size_t param = 0;     // its index in params_ (resolved once params_ is complete)
  };
  std::vector<SharedGradient> shared_gradients_;
  // params_ without the non-primary shared copies: what the gradient norm counts (set when
  // shared_gradients_ is not empty; made once, not per step).
  std::vector<dist::PlacedTensor> norm_params_;
  nlohmann::json model_record_;  // what checkpoints record of the model (checkpoint::model_record), made once
  // The mixture-of-experts layers this rank holds (the model's, or its pipeline stages'), found once.
  std::vector<std::pair<std::string, nn::MoEImpl*>> moe_layers_;
  bool moe_model_ = false;  // the whole model has MoE layers (this rank's stage may have none)
  // Once per step, after the optimizer's update: every MoE layer's routing bias moves towards
  // balance by the step's token counts, summed over the ranks that saw other tokens (dp and cp);
  // not on a skipped step. Counts restart at zero. Returns this rank's layers' load imbalance
  // (StepResult::moe_load, on the device) for a MoE model, else an undefined tensor.
  at::Tensor update_expert_biases(const at::Tensor& skipped);
  // The step's load imbalance over every MoE layer of the model, into the logged figures.
  void set_moe_load(metrics::StepStats& s, const StepResult& r);
  // The auxiliary load-balancing loss (model.moe_aux_loss_coeff or the flavor's): each MoE layer's
  // weight in the loss and its sum of counts over the ranks of the global micro-batch.
  void set_up_moe_aux_loss();
  // The tensor-parallel group under sequence parallelism (its ranks route different tokens), else null.
  dist::Group* sequence_parallel_tp();
  double moe_aux_loss_coeff_ = 0;
  double moe_aux_loss_scale_ = 0;  // 1 / (the model's MoE layers x micro-batches per step)
  Float8Conversion float8_;  // model.converters' float8 recipe and the layers it converted
  bool precompute_float8_scales_ = false;  // quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp, with FSDP float8 all-gather
  void sum_shared_gradients();
  // Whether `name` is a parameter this rank holds as a non-primary copy (see SharedGradient).
  bool is_shared_copy(const std::string& name) const;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<LRSchedule> lr_schedule_;
  std::unique_ptr<data::DataLoader> dataloader_;
  std::unique_ptr<data::DataLoader> val_loader_;  // null unless validation.enable
  std::string val_start_state_;                   // its position at the start: every evaluation reads the same batches
  std::unique_ptr<metrics::MetricsLogger> metrics_;
  std::unique_ptr<metrics::Profiler> profiler_;  // null unless [profiling] traces or memory snapshots are on
  std::unique_ptr<checkpoint::Checkpointer> checkpointer_;
  std::vector<dist::PlacedTensor> params_;
  int64_t grad_accum_steps_ = 1;
  int64_t step_ = 0;
  int64_t lr_step_ = 0;  // the learning-rate schedule's step: step_, unless a resume restored them apart
  int64_t ntokens_seen_ = 0;
  double data_seconds_ = 0;  // time spent waiting for batches since the last log
  bool timeout_set_ = false;  // comm.train_timeout_seconds applied (after this run's first step)
  int64_t skipped_steps_ = 0;  // steps whose update a non-finite loss or gradient norm skipped
  at::Tensor stopped_;  // nan_policy stop: 1 once a step was not finite; every later update is skipped too
  int64_t host_reads_outside_log_steps_ = -1;
  std::function<void(int64_t)> step_callback_;
  // optimizer.early_step_in_backward: every parameter is updated inside the step's last backward as
  // soon as its gradient is final (DataParallel::step_in_backward), and its gradient freed. An
  // update is skipped (on the device) when early_skip_ says so (an earlier step stopped the run, or
  // this rank's loss is not finite) or the gradients updated together have a non-finite norm. The
  // norms taken there (by index in params_) make the step's gradient norm.
  void set_up_early_step();
  bool early_step_ = false;
  at::Tensor early_skip_;
  std::vector<at::Tensor> early_norms_;
  std::string ac_plan_words_;  // activation_checkpoint.mode "memory_budget": the blocks' modes, in words
};

// activation_checkpoint.mode "memory_budget": each block's mode (none, op_all_matmuls, op, full) for a
// config, its world size and device ("cuda" or "cpu"), and the plan in words. The program installs
// the planner (titan estimate's dry runs: tools/estimate.h memory_budget_plan) before it trains.
struct MemoryBudgetPlan {
  std::vector<std::string> block_modes;
  std::string words;
};
using MemoryBudgetPlanner = std::function<MemoryBudgetPlan(const JobConfig&, int64_t world_size, const std::string& device)>;
void set_memory_budget_planner(MemoryBudgetPlanner planner);

// `titan train`: trains with `cfg`, printing torchtitan's log lines. Returns the process exit code.
int run_training(const JobConfig& cfg, const std::function<void()>& preflight = {});
// What ran out `when` ("at step 3") and what to change at `where`: the error of a run that is out of
// memory.
std::string out_of_memory_message(const JobConfig& cfg, const std::string& when, const c10::OutOfMemoryError& e,
                                  OutOfMemoryAt where = OutOfMemoryAt::Step);

// The options whose values differ from the defaults, one "section.key = value" per line.
std::string config_changes(const JobConfig& cfg);

}  // namespace titan
