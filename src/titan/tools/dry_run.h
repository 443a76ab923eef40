// A dry run: one rank's training steps executed on the meta device, for `titan estimate`.
//
// The model is built by its ModelSpec on the meta device (shapes and dtypes, no values, no memory)
// and parallelized by its own parallelize function (TP, CP, activation checkpointing, FSDP/HSDP) exactly
// as the trainer does; DDP, the optimizer, the loss, gradient clipping and the step mirror
// Trainer::train_step. Under pipeline parallelism the rank's stages are built and parallelized as
// Trainer::set_up_pipeline does (one data-parallel layer per stage) and the real dist::PipelineRunner
// runs the rank's actions of the schedule, so the activations alive follow the schedule's order
// (microbatches in flight, split backwards) and the boundary messages are the runner's own. Context
// parallelism runs the real ring attention (dist::ContextParallel) over the fake cp group. Nothing is approximated by a formula: every tensor the real code would
// allocate is allocated on the meta device, where a counting allocator records the bytes alive and
// their peak (as titan's counting CPU allocator does for CPU runs, memory_tracker.h). Collectives go
// through the real dist::Group wrapper over a backend that completes at once and moves nothing
// (collectives, point-to-point messages and all-to-all shifts alike), so the bytes counted per mesh
// dimension are the ones a real run counts (mesh.h). A received message or gathered buffer is
// allocated as the real code allocates it; what other ranks would send is never computed.
//
// What the meta device cannot show by itself is filled in by the dry run, each documented in
// dry_run.cpp: meta kernels for the few operators libtorch has none for (the CPU flash attention,
// index_select, ...), scaled_dot_product_attention routed to the fused kernel the CPU and CUDA choose
// (the meta device would run the math fallback, which materializes S x S scores), and CUDA's bf16
// autocast emulated for models trained without FSDP in mixed precision. The meta tensors stand for
// the rank's device (common/meta_device.h): the loss, the MoE combine, float8 casts and the layers'
// compute dtype take the path of the device estimated. (RMSNorm, RoPE, SwiGLU and the attention
// blocks of context parallelism take their CPU formulation on the meta device: the same saved
// tensors, a few transient fp32 copies more than their CUDA kernels.)
#pragma once

#include "titan/components/quantization/float8_converter.h"
#include "titan/distributed/context_parallel.h"
#include "titan/distributed/mesh.h"
#include "titan/distributed/tensor_parallel.h"
#include "titan/models/pipeline_split.h"

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <memory>
#include <string>
#include <vector>

namespace titan {

// What one rank trains: the model, the batch, the layout and the features that change memory.
struct DryRunPlan {
  std::string model = "llama3", flavor = "debugmodel";
  int64_t seq_len = 2048;
  int64_t local_batch_size = 8;
  int64_t grad_accum_steps = 1;
  at::ScalarType param_dtype = at::kFloat;  // training.dtype: the parameters (and optimizer state)
  // The compute dtype under mixed precision: FSDP gathers parameters in it; without FSDP the forward
  // runs under bf16 autocast when it is bf16 and the parameters are fp32 (CUDA training).
  at::ScalarType mixed_dtype = at::kFloat;
  // What the meta tensors stand for (common/meta_device.h): a CUDA device, or the CPU (false).
  bool cuda = true;
  // Resolved degrees. This rank is member 0 of each group but cp's, where it is the last member
  // (the one whose queries attend to every rank's keys under either split).
  int64_t dp_replicate = 1, dp_shard = 1, cp = 1;
  dist::ContextParallelOptions cp_options;  // cp > 1: how sequences are split and K/V move
  bool fsdp = false;  // FSDP (HSDP with dp_replicate > 1); else DDP when dp_replicate > 1
  int64_t tp = 1;     // tensor-parallel degree (this rank holds TP shard 0)
  int64_t ep = 1;     // expert-parallel degree (out of dp_shard x cp; routing taken as balanced)
  double moe_aux_loss_coeff = 0;  // resolved (models/model.h moe_aux_loss_coeff)
  Float8Conversion float8;                   // model.converters' float8 recipe (none: no converter)
  config::Float8Linear float8_options;
  dist::TensorParallelOptions tp_options;
  std::string reshard_after_forward = "default";
  std::string ac_mode = "none";  // none | full | selective (every ac_every-th block) | op | op_all_matmuls | per_block
  int64_t ac_every = 1;
  std::vector<std::string> ac_block_modes;  // per_block: each layer id's mode
  std::vector<std::string> ac_force_recompute;  // per_op_sac_force_recompute_mm_shapes_by_fqns (op modes)
  bool moe_force_load_balance = false;          // debug.moe_force_load_balance
  std::string optimizer = "AdamW", optimizer_implementation = "fused";
  double max_norm = 1.0;
  bool early_step = false;  // optimizer.early_step_in_backward (no pipeline parallelism)
  int64_t ddp_bucket_bytes = 25 << 20;  // dist::DDP's default
  // Pipeline parallelism (pp > 1): this rank is member pp_rank of the pp group and runs the stages
  // and actions `pipeline` gives it; each microbatch holds pipeline.microbatch_size sequences.
  int64_t pp = 1;
  int pp_rank = 0;
  PipelinePlan pipeline;
};

// Bytes of this rank's tensors (all on its compute device: the meta run does not separate a host).
struct DryRunResult {
  int64_t params = 0;     // parameters as held: FSDP's flat fp32 shards, else the whole model
  int64_t grads = 0;      // gradients at the end of a step: FSDP's flat fp32 gradient shards, else per parameter
  int64_t optimizer = 0;  // AdamW/Adam exp_avg and exp_avg_sq (parameter dtype) and one fp32 step per parameter
  // Kept across steps beyond the above: FSDP's communication buffer pool (gathered units,
  // reduce-scatter inputs and outputs) and model caches such as the RoPE table.
  int64_t buffers = 0;
  // DDP's flattened buckets, all alive at the end of backward (their all-reduces are waited for
  // together); 0 without DDP.
  int64_t ddp_buckets = 0;
  // Bytes alive right after the first micro-batch's loss (forward) in the last step; under pipeline
  // parallelism, right before the rank's first backward action of the last step (its warm-up
  // forwards' activations alive).
  int64_t end_of_forward = 0;
  int64_t peak = 0;            // most bytes alive at once in the second and third steps
  int64_t first_step_peak = 0; // the same for the first step (communication buffers and flat gradients appear)
  std::vector<int64_t> unit_shard_numel;  // FSDP: elements of each unit's flat shard (forward order, root last)
  dist::CommBytes bytes, calls;  // of the last step, per mesh dimension and operation (mesh.h)
  std::vector<int> stages;       // pipeline stages this rank holds (empty without pipeline parallelism)
};

// Counts the bytes of meta tensors allocated during its lifetime, alive and their peak, as a dry run
// does (one at a time; outside one, meta tensors take no count).
class MetaCounting {
 public:
  MetaCounting();
  ~MetaCounting();
  MetaCounting(const MetaCounting&) = delete;
  MetaCounting& operator=(const MetaCounting&) = delete;
  int64_t current() const;
  int64_t peak() const;
  void reset_peak();
};

// The dry run's meta device for its lifetime, for tests of what a layer allocates there: meta
// allocations counted (MetaCounting) and the meta kernels the dry run adds, without autocast.
class DryRunDevice : public MetaCounting {
 public:
  DryRunDevice();
  ~DryRunDevice();

 private:
  std::shared_ptr<void> kernels_;
};

// Runs three training steps of one rank on the meta device and measures the later two (the first
// allocates what later steps reuse). Throws UserError for an unknown model or flavor.
DryRunResult dry_run(const DryRunPlan& plan);

}  // namespace titan
