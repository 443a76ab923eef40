// DDP: every rank holds the whole model; after backward the gradients are summed across the
// replicate group. Gradients are grouped into buckets (in the reverse order of the parameters, the
// order backward produces them); as soon as every gradient of a bucket is accumulated, the bucket is
// flattened and all-reduced asynchronously, overlapping the rest of the backward. Buckets are
// all-reduced in one order on every rank (a bucket waits for those before it), as NCCL's collectives
// must be issued: a bucket holding a parameter this rank's forward did not use is issued by
// finish_backward (its missing gradients as zeros), after the ones before it.
//
// Gradients are summed, not averaged: the trainer's loss is divided by the tokens of the global
// batch already. With gradient accumulation, call set_sync(false) for all but the last micro-batch.
#pragma once

#include "titan/distributed/mesh.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace titan::dist {

class DDP {
 public:
  DDP(const std::vector<std::pair<std::string, at::Tensor>>& params, Group& replicate, int64_t bucket_bytes = 25 << 20);
  ~DDP();
  // Whether the next backward all-reduces (false: gradients only accumulate locally).
  void set_sync(bool sync) { sync_ = sync; }
  // optimizer.early_step_in_backward: `ready` is called with a bucket's parameters once their summed
  // gradients are written back: during backward, when another bucket issues its all-reduce (so at
  // most two buckets' reductions are in flight or awaiting it), and in finish_backward for the last.
  using GradientsReady = std::function<void(const std::vector<at::Tensor>& params)>;
  void set_gradients_ready(GradientsReady ready) { gradients_ready_ = std::move(ready); }
  // Waits for the all-reduces of the last backward and writes the summed gradients back.
  void finish_backward();
  // All-reduces every bucket's gradients now (missing ones as zeros) and waits: the end of a step
  // whose backwards ran without sync.
  void all_reduce_now();
  size_t num_buckets() const { return buckets_.size(); }

  struct Bucket;

 private:
  void issue(Bucket& bucket);   // all-reduces the next bucket in order
  void issue_ready_buckets();   // issues the complete buckets at the head of the order
  Group& group_;
  size_t next_bucket_ = 0;      // the next bucket to issue in this backward
  bool sync_ = true;
  GradientsReady gradients_ready_;
  std::vector<at::Tensor> params_;
  std::vector<std::unique_ptr<Bucket>> buckets_;
};

}  // namespace titan::dist
