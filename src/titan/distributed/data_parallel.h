// The one data-parallel interface: FSDP, HSDP, DDP and none, applied through a model's parallelize
// function and driven the same way by the training step.
//
//   parallelize:  set_placement(name, p)   what another parallelism (TP) made of a parameter
//                 add_unit(parts)          a group of modules gathered and reduced together (FSDP
//                                          shards it; DDP and none ignore units), inner units
//                                          first, the root (prefix "") last
//                 add_expert_unit(parts)   expert parallelism: a MoE layer's routed experts, sharded
//                                          apart over the expert shard group (before its block's unit)
//                 add_grad_sum(name, g)    the parameter's gradient is a partial sum over group g
//                                          (sequence parallel's replicated norms)
//                 finish(model)            every parameter gets its values and placement
//   each step:    before_backward(sync) / after_backward(sync) around every micro-batch's backward
//                 (sync: the last micro-batch of the step, whose backward completes the reductions)
//   any time:     parameters()             what the optimizer steps, with placements: gradient-norm
//                                          clipping, checkpoints and full weights read only these
//
// Choice (kind()): FSDP over the shard group (dp_shard_cp) when it has more than one rank (HSDP with
// the replicate group's replicas) or when asked to shard anyway (CPU offload on one rank); DDP when
// there are only replicas; none otherwise. Parameters built without storage (DeferAllocation) get their values from
// `init` (a block of the global parameter at a start index per dimension): FSDP computes only each
// rank's rows, the others each rank's whole local tensor.
//
// Expert parallelism: the experts (each rank's E/ep of them) are FSDP units of a second FSDP over the
// expert shard group ("efsdp", dp_shard x cp / ep ranks holding the same experts; possibly one rank)
// with the same replicas, as torchtitan shards experts over its efsdp mesh. Dense parameters stay on
// the dp_shard_cp FSDP.
#pragma once

#include "titan/distributed/ddp.h"
#include "titan/distributed/fsdp.h"
#include "titan/distributed/mesh.h"
#include "titan/distributed/placement.h"

#include <torch/nn/module.h>

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace titan::dist {

using InitRegion = std::function<void(const std::string& name, at::Tensor out, const std::vector<int64_t>& begin)>;

struct DataParallelOptions {
  FSDPOptions fsdp;
  bool shard_always = false;  // FSDP even over one rank (CPU offload)
  int64_t ddp_bucket_bytes = 25 << 20;
};

class DataParallel {
 public:
  // shard, replicate: the dp_shard_cp and dp_replicate groups. comm_device: where collective inputs
  // must live (Mesh::device()).
  // expert_shard: the efsdp group under expert parallelism, else null.
  DataParallel(Group& shard, Group& replicate, DataParallelOptions options, InitRegion init, at::Device comm_device,
               Group* expert_shard = nullptr);
  ~DataParallel();
  // "FSDP", "HSDP", "DDP" or "none".
  std::string kind() const;

  void set_placement(const std::string& name, Placement placement);
  void add_grad_sum(const std::string& name, Group& group);
  void add_unit(const std::vector<UnitPart>& parts, bool keep_after_forward = false);
  void add_expert_unit(const std::vector<UnitPart>& parts);
  void finish(torch::nn::Module& model);

  void before_backward(bool sync);
  void after_backward(bool sync);
  // Pipeline parallelism: with gradient sync off, backward passes (any number, in any order) only
  // accumulate local gradients (FSDP's full ones); reduce_gradients() then reduces them all at once,
  // as the last micro-batch's backward would have.
  void set_gradient_sync(bool sync);
  void reduce_gradients();
  // optimizer.early_step_in_backward: `step` updates parameters (as parameters() holds them) whose
  // gradients for the step are final; their gradients are dropped when it returns. It is called in
  // the backward of the step's last micro-batch (before_backward(true)), as soon as they are final:
  // under FSDP and HSDP a unit's shards once its reductions have landed, under DDP a bucket's
  // parameters once its all-reduce has, without data parallelism each parameter as autograd
  // accumulates its gradient; parameters with partial gradients (add_grad_sum) in after_backward,
  // once summed. Every parameter once per step (one that got no gradient, without data
  // parallelism, not at all). Call after finish(); not with pipeline parallelism.
  using StepParameters = std::function<void(const std::vector<at::Tensor>& params)>;
  void step_in_backward(StepParameters step);
  const std::vector<PlacedTensor>& parameters() const { return params_; }
  std::vector<std::pair<std::string, at::Tensor>> named_parameters() const;

  FSDP* fsdp() const { return fsdp_.get(); }
  FSDP* experts_fsdp() const { return experts_fsdp_.get(); }
  DDP* ddp() const { return ddp_.get(); }

 private:
  Placement base(const std::string& name, const at::Tensor& local) const;
  void reduce_partial_sums();  // the partial gradients (add_grad_sum) summed over their groups
  void gradients_final(const std::vector<at::Tensor>& params);  // step_in_backward's part of a ready set
  InitRows init_rows() const;  // FSDP's rows of the local tensors, from init_
  Group& shard_;
  Group& replicate_;
  at::Device comm_device_;
  DataParallelOptions options_;
  InitRegion init_;
  std::unique_ptr<FSDP> fsdp_;
  std::unique_ptr<FSDP> experts_fsdp_;  // expert parallelism's
  std::unique_ptr<DDP> ddp_;
  bool use_ddp_ = false;
  std::map<std::string, Placement> placements_;      // set by other parallelisms
  std::map<std::string, std::vector<Group*>> sums_;  // partial gradients to add over groups
  std::vector<PlacedTensor> params_;
  bool finished_ = false;
  StepParameters step_;
  bool final_backward_ = true;
  std::set<const void*> deferred_;  // step_in_backward: parameters with partial gradients (by TensorImpl)
  std::vector<at::Tensor> hooked_;  // step_in_backward without data parallelism: the parameters hooked
};

}  // namespace titan::dist
