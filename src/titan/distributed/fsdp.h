// FSDP (like PyTorch's FSDP2 fully_shard, ZeRO-3): parameters, gradients and optimizer state sharded
// on dim 0 across the data-parallel shard group, for a model written for one device.
//
// Each unit (a transformer block, and the root: everything else) keeps, per parameter:
//   shard  (ceil(R / N), ...) fp32 leaf: this rank's rows of the (padded) parameter; the optimizer
//          steps these. Rows past R are padding: zero values, zero gradients.
//   full   the module's own parameter (R, ...) in param_dtype; its storage is allocated only while
//          the unit is unsharded (its forward and its backward) and freed otherwise.
// Before a unit's forward its shards are all-gathered into `full` (param_dtype); after the forward
// it reshards (blocks by default; the root keeps its parameters, its backward comes first). A hook
// on the unit's output all-gathers again before its backward. When every parameter of the unit has
// its gradient, the gradients are cast to reduce_dtype and reduce-scattered (summed) into the
// shards' gradients, and the full parameters and gradients are freed. The next unit's all-gather is
// issued before the current unit computes (prefetch), so communication overlaps compute.
// With a replicate group (HSDP) the reduce-scattered gradients are then all-reduced across replicas.
//
// Gradients are summed, not averaged: the trainer's loss is already divided by the tokens of the
// whole global batch, so the sum over ranks is the single-process gradient.
#pragma once

#include "titan/distributed/mesh.h"
#include "titan/distributed/placement.h"
#include "titan/models/common/hooks.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace titan::dist {

struct FSDPOptions {
  at::ScalarType param_dtype = at::kFloat;   // all-gather and compute dtype (mixed_precision_param)
  at::ScalarType reduce_dtype = at::kFloat;  // gradient reduction dtype (mixed_precision_reduce)
  std::string reshard_after_forward = "default";  // default (all but the root) | always | never
};

class FSDP {
 public:
  // shard: the group parameters are sharded over; replicate: the HSDP replica group, or null.
  FSDP(Group& shard, Group* replicate, FSDPOptions options);
  ~FSDP();

  // Makes `module` (called `prefix` in the model: "layers.3." or "" for the root) a unit owning its
  // parameters not yet owned by a unit: their fp32 values are sharded and their full storage freed.
  // Parameters created under DeferAllocation (no storage yet) are first given storage and `init` is
  // called to fill them (layout-independent init fills only tensors with storage), so at most one
  // unit is ever held whole. Inner units first in forward order, the root last.
  void fully_shard(nn::HookedModule& module, const std::string& prefix, const std::function<void()>& init = {});

  // (global name, shard) of every parameter, for the optimizer.
  std::vector<std::pair<std::string, at::Tensor>> sharded_parameters() const;
  // Every shard with its placement: dim 0 chunked over the shard group (padded), replicated over
  // the replicate group (the replica of rank 0 in it is primary).
  std::vector<PlacedTensor> placed_parameters() const;
  // Waits for the gradient reductions issued during backward; call after loss.backward().
  void finish_backward();
  // Most bytes of padded full-size gradients held for reduce-scatters at once so far: one unit's,
  // since a unit's reductions complete before the next unit issues its own.
  int64_t peak_reduction_bytes() const { return peak_reduction_bytes_; }

  struct Unit;

 private:
  Group& shard_;
  Group* replicate_;
  FSDPOptions options_;
  std::vector<std::unique_ptr<Unit>> units_;  // in forward order; the root last
  int64_t peak_reduction_bytes_ = 0;
};

}  // namespace titan::dist
