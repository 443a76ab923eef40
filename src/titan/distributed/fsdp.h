// FSDP (like PyTorch's FSDP2 fully_shard, ZeRO-3): parameters, gradients and optimizer state sharded
// on dim 0 across the data-parallel shard group, for a model written for one device.
//
// A unit is a group of modules (a transformer block; [norm, output]; the root with the embedding)
// whose parameters are gathered and reduced together. Each parameter of R rows is split by
// torch.chunk's rule: rank k holds rows [k·s, (k+1)·s) of the parameter padded to N·s rows, s =
// ceil(R / N). A unit keeps, per rank:
//   flat shard  one fp32 buffer with every parameter's (s, ...) rows one after the other; each
//               parameter's shard is a leaf tensor over its part (the optimizer steps these).
//               Padding rows hold zeros and get zero gradients.
//   flat grad   the same layout for the shards' gradients (the shards' .grad are views of it),
//               allocated by a step's first reduction; the unit does not hold it, so zero_grad
//               (set to none) frees it and no gradient memory is kept through the next forward.
//   full        the modules' own parameters (R, ...) in param_dtype; their storage points into a
//               gathered buffer only while the unit is unsharded (its forward and its backward).
// Before a unit's forward its flat shard is all-gathered (one collective, in param_dtype) and copied
// out into the full parameters; after the forward it reshards (blocks by default; the root and the
// last unit keep their parameters, their backward comes first). A hook on the unit's output
// all-gathers again before its backward. When every parameter of the unit has its gradient, the
// gradients are cast to reduce_dtype, laid out like the flat shard of every rank and reduce-scattered
// (one collective, summed) into the flat grad, and the full parameters and gradients are freed. With
// a replicate group (HSDP) the reduced shard is then all-reduced over replicas: issued when the next
// unit reduces and waited for at the end of backward, off the critical path. The next unit's
// all-gather is issued before the current unit computes (prefetch).
//
// Communication buffers come from a pool: a request takes the smallest free buffer of its dtype and
// device that is large enough (units of every size share them), so the pool holds what is in flight
// at once, not a set per unit size. When a backward ends the pool returns its buffers to the
// allocator (on CUDA the caching allocator, where the next forward's activations can use them):
// each phase takes the buffers it uses, the same number every step. With offload_to_cpu the flat shards and grads
// live in CPU memory (pinned when the compute device is a GPU): the optimizer steps on the CPU, each
// all-gather first copies the shard to the device and each reduced gradient is copied back.
//
// Float8 all-gather (FSDPOptions::float8_all_gather): in a unit holding float8 linear layers of the
// tensorwise recipe, each such weight's shard is cast to float8 e4m3 with the scale of the whole
// weight (448 / its amax, the maximum of every rank's shard amax: one all-reduce of the unit's amaxes
// over the shard group, and over the tensor-parallel group for TP-split weights; at the unit's first
// gather, kept for its later gathers until a backward with gradient sync ends), and the unit's
// all-gather moves these bytes together with its other parameters' param_dtype ones (one collective
// of bytes). The gathered float8 weight and its scale go to the layer (nn::Float8Weight), which
// multiplies with them instead of casting its weight, in forward and for grad_input; the layer's
// param_dtype weight is never materialized, and its gradient is reduced as any other.
// precompute_float8_scales() computes every unit's scales after an optimizer step with one
// all-reduce (per FSDP, and one more over the tp group under TP), and the gathers until the next
// call use them, off the gathers' path (torchao's
// precompute_float8_dynamic_scale_for_fsdp). The casts equal the layer's own cast of the gathered
// weight when param_dtype is fp32; with bf16 the float8 bytes come from the fp32 shard, one
// rounding fewer.
//
// Gradients are summed, not averaged: the trainer's loss is already divided by the tokens of the
// whole global batch, so the sum over ranks is the single-process gradient.
#pragma once

#include "titan/distributed/mesh.h"
#include "titan/distributed/placement.h"
#include "titan/nn/hooks.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace titan::dist {

struct FSDPOptions {
  at::ScalarType param_dtype = at::kFloat;   // all-gather and compute dtype (mixed_precision_param)
  at::ScalarType reduce_dtype = at::kFloat;  // gradient reduction dtype (mixed_precision_reduce)
  std::string reshard_after_forward = "default";  // default (blocks only) | always | never
  // FSDP2's set_reshard_after_backward: with false, a backward without gradient sync leaves the
  // units gathered, so the next microbatch's forward and backward reuse them (pipeline parallelism:
  // each unit is gathered once per step and reduce-scattered once, when the step's gradients reduce).
  bool reshard_after_backward = true;
  // Communication buffers go back to the allocator when a backward ends (where nothing is in
  // flight), so no reduce-scatter buffer sits idle through the next forward. false keeps them
  // pooled across steps, to measure what returning them saves.
  bool return_buffers = true;
  bool offload_to_cpu = false;  // training.enable_cpu_offload
  // quantize.linear.float8.enable_fsdp_float8_all_gather: the weights of float8 linear layers (the
  // tensorwise recipe) are cast to float8 before the all-gather, which moves 1 byte per element (see
  // the header's float8 paragraph).
  bool float8_all_gather = false;
};

// Writes rows [first_row, first_row + rows.size(0)) of parameter `name`'s initial values into `rows`:
// FSDP initializes only the rows of this rank's shard of parameters built without memory.
using InitRows = std::function<void(const std::string& name, at::Tensor rows, int64_t first_row)>;

// One module of a unit: its name in the model ("layers.3.", "norm.", "" for the root) and the module.
struct UnitPart {
  std::string prefix;
  nn::HookedModule* module;
};

class FSDP {
 public:
  // shard: the group parameters are sharded over; replicate: the HSDP replica group, or null.
  FSDP(Group& shard, Group* replicate, FSDPOptions options);
  ~FSDP();

  // Makes the modules of `parts` one unit owning their parameters not yet owned by a unit: their
  // fp32 values are sharded and their full storage freed. The unit is gathered before the first
  // part's forward and its forward ends with the last part's. Parameters created under
  // DeferAllocation (no storage yet) get only their shard's memory, filled by `init`, so no rank
  // holds more of the model than its shards. Units are sharded in forward order, the root (the
  // whole model, prefix "") last. keep_after_forward: under reshard_after_forward "default", do not
  // reshard this unit after its forward (the root always keeps).
  void fully_shard(const std::vector<UnitPart>& parts, const InitRows& init = {}, bool keep_after_forward = false);
  void fully_shard(nn::HookedModule& module, const std::string& prefix, const InitRows& init = {}) {
    fully_shard({{prefix, &module}}, init);
  }

  // Parameters the units of this FSDP leave alone (another FSDP shards them: expert parallelism's
  // experts), before the units that hold them are made.
  void skip(const std::vector<at::Tensor>& params);
  // Links the units in execution order, for an FSDP whose units are all inner ones (no root unit:
  // the experts' FSDP), after the last fully_shard.
  void link();

  // (global name, shard) of every parameter, for the optimizer.
  std::vector<std::pair<std::string, at::Tensor>> sharded_parameters() const;
  // Every shard with its placement: dim 0 chunked over the shard group (padded), replicated over
  // the replicate group (the replica of rank 0 in it is primary).
  std::vector<PlacedTensor> placed_parameters() const;
  // Float8 all-gather: every unit's float8 weights' scales from their current values (after the
  // optimizer step), with one all-reduce of all their amaxes; used by the gathers until the next call.
  void precompute_float8_scales();
  // Float8 all-gather: the layers whose weights are gathered in float8.
  int64_t num_float8_gathered() const;

  // Waits for the gradient reductions issued during backward; call after loss.backward().
  void finish_backward();
  // FSDP2's set_requires_gradient_sync: with false, backward passes reduce nothing; each unit's full
  // gradients accumulate over them (one unit's parameters are resharded when its backward is done)
  // until a backward with sync on, or reduce_now(). Pipeline parallelism runs a step's microbatches
  // this way, in whatever order its schedule interleaves their forwards and backwards.
  void set_requires_gradient_sync(bool sync) { sync_gradients_ = sync; }
  // Reduce-scatters every unit's accumulated full gradients (units in backward order) into the
  // sharded gradients and waits: the end of a step whose backwards ran without sync.
  void reduce_now() {
    const bool sync = sync_gradients_;
    sync_gradients_ = true;
    finish_backward();
    sync_gradients_ = sync;
  }
  // optimizer.early_step_in_backward: `ready` is called with a unit's shards as soon as a backward
  // marked final (the step's last) has made their gradients final: when the unit's reduce-scatter
  // (with HSDP, its all-reduce over replicas) has landed, inside the backward or in
  // finish_backward; with CPU offload from a GPU, in finish_backward once the copies to the host
  // have completed. Every unit once per final backward, in the order their reductions complete.
  using GradientsReady = std::function<void(const std::vector<at::Tensor>& shards)>;
  void set_gradients_ready(GradientsReady ready) { gradients_ready_ = std::move(ready); }
  void set_final_backward(bool final) { final_backward_ = final; }
  // Most bytes of padded full-size gradients held for reduce-scatters at once so far: one unit's,
  // since a unit's reductions complete before the next unit issues its own.
  int64_t peak_reduction_bytes() const { return peak_reduction_bytes_; }
  // Communication buffers allocated so far (the pool reuses them within a step; with
  // return_buffers the same number is allocated again every step).
  int64_t buffer_allocations() const { return pool_allocations_; }
  // Bytes of free buffers the pool holds now (0 after a backward with return_buffers), of one
  // dtype or (Undefined) all.
  int64_t pooled_bytes(at::ScalarType dtype = at::ScalarType::Undefined) const;
  size_t num_units() const { return units_.size(); }

  struct Unit;

 private:
  friend struct Unit;
  at::Tensor acquire(int64_t numel, at::ScalarType dtype, const at::Device& device);
  void release(at::Tensor& buffer);
  void link_units(Unit* root);  // execution order of the units; root null when it has no unit

  Group& shard_;
  Group* replicate_;
  FSDPOptions options_;
  std::vector<std::unique_ptr<Unit>> units_;  // in forward order; the root last
  // Free buffers per (dtype, device), and the base buffer of each one handed out (by storage).
  std::map<std::pair<at::ScalarType, std::string>, std::vector<at::Tensor>> free_;
  std::map<const void*, at::Tensor> in_use_;
  int64_t pool_allocations_ = 0;
  // CPU offload from a GPU: gradient copies to pinned host memory in flight, and the sums they feed.
  bool host_copies_pending_ = false;
  std::vector<std::pair<at::Tensor, at::Tensor>> host_adds_;
  bool sync_gradients_ = true;
  GradientsReady gradients_ready_;
  bool final_backward_ = true;
  bool rooted_ = false;  // the last unit is the root (the model), whose backward comes last
  std::set<const void*> skipped_;
  int64_t peak_reduction_bytes_ = 0;
};

}  // namespace titan::dist
