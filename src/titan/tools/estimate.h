// `titan estimate`: what one rank of a training run holds in memory, computes and communicates per
// step, for a config and a layout, without running it.
//
// The figures come from a dry run (dry_run.h): the run's own model, parallelize function, FSDP/DDP,
// optimizer and train step executed on the meta device, which has shapes and dtypes but no memory,
// with every allocation counted. So they follow the model's real shapes and the code's real buffers
// (no rule of thumb), and even 405B needs no memory for weights. On the CPU the prediction is the
// figure the log line's `memory:` reports (peak bytes of CPU tensors, memory_tracker.h); on CUDA it
// is the caching allocator's allocated bytes, which its reserved bytes (the log line) exceed by the
// allocator's fragmentation, and the CUDA context and NCCL's buffers come on top.
//
// Context parallelism: the dry run's rank holds seq_len / cp tokens of every sequence and runs the
// real ring attention. Pipeline parallelism: every pipeline rank is dry-run (its stages, its actions
// of the schedule); the report's figures are the worst rank's, and each rank's peak is listed.
#pragma once

#include "titan/config/job_config.h"
#include "titan/distributed/mesh.h"
#include "titan/trainer/trainer.h"

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace titan {

// ---- Whole-model figures (no layout).
struct ModelEstimate {
  std::string model, flavor;
  int64_t seq_len = 0;
  int64_t params = 0;            // all parameter elements (tied tensors once)
  double flops_per_token = 0;    // training (forward + backward), torchtitan's formula
  int64_t param_bytes = 0;       // fp32 master weights
  int64_t grad_bytes = 0;        // fp32 gradients
  int64_t optimizer_bytes = 0;   // AdamW exp_avg + exp_avg_sq, fp32
  int64_t largest_param = 0;     // elements of the largest parameter
};

ModelEstimate estimate_model(const std::string& model, const std::string& flavor, int64_t seq_len);

// ---- Per-rank estimate of a config and layout.
struct EstimateOptions {
  // Ranks of the run. 0: the product of the configured degrees, a data_parallel_shard_degree of -1
  // counting as 1 (one rank unless other degrees say more).
  int64_t world_size = 0;
  // What the ranks compute on: "cuda" (mixed_precision_param applies: FSDP gathers bf16 parameters,
  // otherwise bf16 autocast) or "cpu" (fp32 compute, as titan trains on CPUs).
  std::string device = "cuda";
  double device_memory_gib = 80;  // capacity the verdict compares the peak with
  // Also dry-run the other activation checkpointing modes (Estimate::peak_by_ac); the pre-flight
  // check asks for them only when the configured mode does not fit.
  bool other_ac_modes = true;
};

struct Estimate {
  ModelEstimate model;
  // "FSDP", "HSDP", "DDP" or "single process", then "+ TP n", "+ CP n", "+ PP n" where they apply
  std::string layout;
  std::string degrees;       // ParallelDims::describe()
  int64_t world_size = 1, shard_degree = 1;  // shard_degree: the ranks parameters are sharded over
  std::string device;        // "cuda" or "cpu"
  std::string compute_dtype, param_dtype;  // e.g. "bfloat16", "float32"
  bool offload = false;      // training.enable_cpu_offload
  std::string activation_checkpointing;   // as configured, in words
  // activation_checkpoint.mode "memory_budget": each block's mode (none, op_all_matmuls, op, full) as
  // the dry runs chose it; empty otherwise.
  std::vector<std::string> ac_block_modes;
  int64_t local_batch_size = 0, grad_accum_steps = 1;

  // Bytes per rank. params, grads and optimizer are where they are held: the host when offloaded
  // to a GPU's CPU, else the device.
  int64_t params = 0, grads = 0, optimizer = 0;
  bool fsdp = false;         // FSDP shards the state (fp32 shards; gradient shards from its reductions)
  bool early_step = false;   // optimizer.early_step_in_backward: each gradient freed by its update in backward
  int64_t buffers = 0;       // kept across steps: FSDP's communication buffer pool, model caches (RoPE table)
  int64_t ddp_buckets = 0;   // DDP's flattened gradient buckets, alive together at the end of backward
  int64_t activations = 0;   // alive at the end of forward (with the loss's saved logits and the batch)
  int64_t backward = 0;      // the peak over the end of forward (gradients produced, recomputation, temporaries)
  int64_t peak_device = 0;   // predicted peak of the compute device (the CPU's when device is cpu)
  int64_t host = 0;          // CPU memory of the offloaded state (0 without offload to a GPU's host)
  // Resuming from a checkpoint (at start-up, before the first step): parameters, optimizer state and
  // buffers, plus one block being read. Blocks are read on the host, checked on every rank, then read
  // again straight into the live tensors, one at a time: no second copy of the state. load_block is
  // the largest parameter's piece on this rank, in the parameter dtype (on the host; on the device too
  // when it is the CPU).
  int64_t load_peak = 0, load_block = 0;
  // The device peak under the other activation checkpointing modes: "none", "full", "selective k".
  std::map<std::string, int64_t> peak_by_ac;

  double flops_per_step = 0;  // this rank's training FLOPs per optimizer step (its stages' under PP)
  int64_t tokens_per_step = 0;  // of this rank's data-parallel share (whole sequences; CP ranks hold 1/cp of each)
  dist::CommBytes comm_bytes, comm_calls;  // per step, per mesh dimension and operation (mesh.h's counting)

  // Context parallelism (cp > 1): how sequences are split and K/V move (parallelism.context_parallel_*).
  int64_t cp = 1;
  std::string cp_split, cp_rotate;

  // Pipeline parallelism (pp > 1). The figures above are those of the worst pipeline rank (the
  // largest peak); every rank's are here.
  int64_t pp = 1;
  std::string schedule;  // the schedule's name, or its CSV file
  int num_stages = 1, microbatches = 1;
  int64_t microbatch_size = 0;
  struct PipelineRank {
    int rank = 0;
    std::vector<int> stages;  // the stages it holds
    // Most (stage, microbatch) activations alive at once: from a forward to the backward (W for a
    // split backward) that releases them, counted from the rank's order of actions. GPipe: all
    // microbatches; 1F1B: min(pp - rank, microbatches).
    int in_flight = 0;
    int64_t params = 0, peak = 0, activations = 0;
    double flops_per_step = 0;
    dist::CommBytes comm_bytes, comm_calls;
  };
  std::vector<PipelineRank> pipeline_ranks;
  int worst_pp_rank = 0;

  int64_t capacity = 0;  // bytes
  bool fits = false;
};

// Throws UserError for configs titan cannot train (the same checks as titan train) and for
// unknown options.
Estimate estimate(const JobConfig& cfg, const EstimateOptions& options);
// Human-readable report, one quantity per line, ending with the verdict.
std::string format_estimate(const Estimate& e);
// activation_checkpoint.mode "memory_budget": the blocks' modes the estimate's dry runs choose for
// this config on `world_size` ranks computing on `device` (what titan train installs with
// set_memory_budget_planner).
MemoryBudgetPlan memory_budget_plan(const JobConfig& cfg, int64_t world_size, const std::string& device);

// What memory_budget_plan does with the dry runs' figures. The budget b places the activations alive
// at the end of forward (the worst pipeline rank's; `activations` measures them for one mode per
// block) between those of checkpointing every block in full (b = 0) and of none (b = 1), as
// torchtitan's budget places its compiled partitioner: at most A_full + b (A_none - A_full). The
// cheapest recomputation comes first: blocks move from none to per operator with every matmul kept,
// then to per operator with every other matmul kept, then to in full (each rung recomputes what the
// one before does and more); a rung that saves nothing over the one below is skipped. Between two
// neighbouring rungs the first k blocks of memory_budget_upgrade_order take the higher, the fewest k
// whose activations meet the bound (bisected: about log2(blocks) more measurements after the four
// uniform ones).
MemoryBudgetPlan resolve_memory_budget(double budget, int64_t blocks,
                                       const std::function<int64_t(const std::vector<std::string>&)>& activations);
// The order in which memory_budget moves blocks to a costlier mode: every prefix spread evenly over
// the layer ids (0, n/2, n/4, 3n/4, ...), and the blocks chosen for k are those for k - 1 and one
// more, so that no pipeline rank's share falls as k grows (the activations fall with k, which the
// bisection needs).
std::vector<int64_t> memory_budget_upgrade_order(int64_t blocks);

}  // namespace titan
