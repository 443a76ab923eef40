#include "titan/distributed/data_parallel.h"

#include "titan/common/error.h"
#include "titan/common/tensor_storage.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <set>

namespace titan::dist {

DataParallel::DataParallel(Group& shard, Group& replicate, DataParallelOptions options, InitRegion init,
                           at::Device comm_device, Group* expert_shard)
    : shard_(shard), replicate_(replicate), comm_device_(comm_device), options_(std::move(options)),
      init_(std::move(init)) {
  if (shard.size() > 1 || options_.shard_always)
    fsdp_ = std::make_unique<FSDP>(shard, &replicate, options_.fsdp);
  else
    use_ddp_ = replicate.size() > 1;
  if (expert_shard) {
    TITAN_ASSERT(fsdp_, "expert parallelism borrows FSDP ranks: it needs FSDP");
    experts_fsdp_ = std::make_unique<FSDP>(*expert_shard, &replicate, options_.fsdp);
  }
}

DataParallel::~DataParallel() {
  for (const at::Tensor& p : hooked_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

namespace {
// step_in_backward without data parallelism: a parameter's gradient is final when autograd has
// accumulated it in the step's last backward.
struct StepWhenAccumulated : torch::autograd::PostAccumulateGradHook {
  std::function<void(const at::Tensor&)> on_accumulated;
  explicit StepWhenAccumulated(std::function<void(const at::Tensor&)> f) : on_accumulated(std::move(f)) {}
  void operator()(const torch::autograd::Variable& param) override { on_accumulated(param); }
};
}  // namespace

void DataParallel::step_in_backward(StepParameters step) {
  TITAN_ASSERT(finished_ && !step_, "step_in_backward once, after finish");
  step_ = std::move(step);
  for (const auto& p : params_)
    if (sums_.count(p.name)) deferred_.insert(p.local.unsafeGetTensorImpl());
  auto ready = [this](const std::vector<at::Tensor>& params) { gradients_final(params); };
  if (fsdp_) fsdp_->set_gradients_ready(ready);
  if (experts_fsdp_) experts_fsdp_->set_gradients_ready(ready);
  if (ddp_) ddp_->set_gradients_ready(ready);
  if (fsdp_ || ddp_) return;
  for (const auto& p : params_) {
    if (deferred_.count(p.local.unsafeGetTensorImpl()) || !p.local.requires_grad()) continue;
    TITAN_ASSERT(!torch::autograd::impl::post_acc_grad_hooks(p.local), "parameter ", p.name,
                 " already has a post-accumulation hook");
    torch::autograd::impl::set_post_acc_grad_hooks(p.local, std::make_unique<StepWhenAccumulated>([this](const at::Tensor& t) {
                                                    if (final_backward_) gradients_final({t});
                                                  }));
    hooked_.push_back(p.local);
  }
}

void DataParallel::gradients_final(const std::vector<at::Tensor>& params) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> now;
  for (const at::Tensor& p : params) {
    if (!deferred_.count(p.unsafeGetTensorImpl())) {
      now.push_back(p);
    } else if (p.grad().defined()) {  // summed in after_backward: its own copy, so that the rest (FSDP: a flat buffer) can go
      p.mutable_grad() = p.grad().clone();
    }
  }
  if (now.empty()) return;
  step_(now);
  for (const at::Tensor& p : now) p.mutable_grad() = at::Tensor();  // (the gradient, not the parameter)
}

std::string DataParallel::kind() const {
  if (fsdp_) return replicate_.size() > 1 ? "HSDP" : "FSDP";
  return use_ddp_ ? "DDP" : "none";
}

void DataParallel::set_placement(const std::string& name, Placement placement) {
  TITAN_ASSERT(!finished_, "set_placement after finish");
  placements_[name] = std::move(placement);
}

void DataParallel::add_grad_sum(const std::string& name, Group& group) {
  if (group.size() > 1) sums_[name].push_back(&group);
}

Placement DataParallel::base(const std::string& name, const at::Tensor& local) const {
  auto it = placements_.find(name);
  return it != placements_.end() ? it->second : whole(local);
}

InitRows DataParallel::init_rows() const {
  // FSDP initializes rows of the local tensor (a TP or EP shard, or the whole parameter): a block of
  // the global parameter starting where the local tensor does, offset by the first row.
  return [this](const std::string& name, at::Tensor rows, int64_t first_row) {
    auto it = placements_.find(name);
    std::vector<int64_t> begin =
        it != placements_.end() ? it->second.global_begin() : std::vector<int64_t>(rows.dim(), 0);
    begin[0] += first_row;
    init_(name, std::move(rows), begin);
  };
}

void DataParallel::add_unit(const std::vector<UnitPart>& parts, bool keep_after_forward) {
  TITAN_ASSERT(!finished_, "add_unit after finish");
  if (!fsdp_) return;
  fsdp_->fully_shard(parts, init_rows(), keep_after_forward);
}

void DataParallel::add_expert_unit(const std::vector<UnitPart>& parts) {
  TITAN_ASSERT(!finished_ && experts_fsdp_, "add_expert_unit without expert parallelism, or after finish");
  std::vector<at::Tensor> params;
  for (const auto& part : parts)
    for (const auto& p : part.module->named_parameters()) params.push_back(p.value());
  experts_fsdp_->fully_shard(parts, init_rows());
  fsdp_->skip(params);  // the dense units leave them alone
}

void DataParallel::finish(torch::nn::Module& model) {
  TITAN_ASSERT(!finished_, "DataParallel::finish twice");
  finished_ = true;
  params_.clear();
  if (fsdp_) {
    std::set<std::string> owned;
    std::vector<PlacedTensor> placed = fsdp_->placed_parameters();
    if (experts_fsdp_) {
      experts_fsdp_->link();
      for (auto& p : experts_fsdp_->placed_parameters()) placed.push_back(std::move(p));
    }
    for (auto& p : placed) {
      owned.insert(p.name);
      auto it = placements_.find(p.name);  // FSDP's placement is of the local tensor: a TP shard, or the whole
      params_.push_back({p.name, p.local, it != placements_.end() ? compose(it->second, p.placement) : p.placement});
    }
    for (const auto& p : model.named_parameters())
      TITAN_ASSERT(owned.count(p.key()), "FSDP: parameter ", p.key(), " is in no unit (shard the root last)");
  } else {
    at::NoGradGuard no_grad;
    Group& replicas = replicate_;
    for (const auto& item : model.named_parameters()) {
      const at::Tensor& local = item.value();
      Placement pl = base(item.key(), local);
      if (!has_storage(local)) {  // built without memory: this rank's local tensor only
        allocate_storage(local);
        init_(item.key(), local, pl.global_begin());
      }
      if (replicas.size() > 1) {
        pl.replicated.push_back(replicas.name());
        pl.primary = pl.primary && replicas.rank() == 0;
      }
      params_.push_back({item.key(), local, std::move(pl)});
    }
    if (use_ddp_) ddp_ = std::make_unique<DDP>(named_parameters(), replicas, options_.ddp_bucket_bytes);
  }
  for (const auto& [name, groups] : sums_) {
    bool found = false;
    for (const auto& p : params_) found = found || p.name == name;
    TITAN_ASSERT(found, "add_grad_sum of an unknown parameter ", name);
  }
}

std::vector<std::pair<std::string, at::Tensor>> DataParallel::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : params_) out.emplace_back(p.name, p.local);
  return out;
}

void DataParallel::before_backward(bool sync) {
  if (ddp_) ddp_->set_sync(sync);
  final_backward_ = sync;
  if (fsdp_) fsdp_->set_final_backward(sync);
  if (experts_fsdp_) experts_fsdp_->set_final_backward(sync);
}

void DataParallel::set_gradient_sync(bool sync) {
  if (fsdp_) fsdp_->set_requires_gradient_sync(sync);
  if (experts_fsdp_) experts_fsdp_->set_requires_gradient_sync(sync);
  if (ddp_) ddp_->set_sync(sync);
}

void DataParallel::reduce_gradients() {
  if (fsdp_) fsdp_->reduce_now();
  if (experts_fsdp_) experts_fsdp_->reduce_now();
  if (ddp_) ddp_->all_reduce_now();
  reduce_partial_sums();
}

void DataParallel::after_backward(bool sync) {
  if (fsdp_) fsdp_->finish_backward();
  if (experts_fsdp_) experts_fsdp_->finish_backward();
  if (ddp_ && sync) ddp_->finish_backward();
  if (sync) reduce_partial_sums();
  if (step_ && sync && !deferred_.empty()) {
    std::vector<at::Tensor> summed;
    for (const auto& p : params_)
      if (deferred_.count(p.local.unsafeGetTensorImpl())) summed.push_back(p.local);
    step_(summed);
    for (at::Tensor& p : summed) p.mutable_grad() = at::Tensor();
  }
}

void DataParallel::reduce_partial_sums() {
  if (sums_.empty()) return;
  // Partial gradients summed over their groups once per step (after the last micro-batch: the
  // accumulated gradient is a sum of partial sums), one all-reduce per group.
  at::NoGradGuard no_grad;
  std::map<std::string, std::pair<Group*, std::vector<at::Tensor>>> by_group;
  for (const auto& p : params_) {
    auto it = sums_.find(p.name);
    if (it == sums_.end()) continue;
    at::Tensor& grad = p.local.mutable_grad();
    if (!grad.defined()) grad = at::zeros_like(p.local);  // every rank issues the same collective
    for (Group* g : it->second) {
      auto& entry = by_group[g->name()];
      entry.first = g;
      entry.second.push_back(grad);
    }
  }
  // In buckets of about ddp_bucket_bytes (a MoE model under sequence parallelism has most of its
  // gradients here: one buffer of them all would be another copy of the rank's gradients).
  for (auto& [name, entry] : by_group) {
    std::vector<at::Tensor>& grads = entry.second;
    for (size_t begin = 0; begin < grads.size();) {
      size_t end = begin;
      int64_t bytes = 0;
      while (end < grads.size() && (end == begin || bytes + grads[end].numel() * grads[end].element_size() <=
                                                         options_.ddp_bucket_bytes)) {
        bytes += grads[end].numel() * grads[end].element_size();
        ++end;
      }
      std::vector<at::Tensor> flat;
      for (size_t i = begin; i < end; ++i) flat.push_back(grads[i].reshape({-1}));
      at::Tensor buf = at::cat(flat).to(comm_device_);
      entry.first->all_reduce(buf).wait();
      int64_t offset = 0;
      for (size_t i = begin; i < end; ++i) {
        grads[i].copy_(buf.slice(0, offset, offset + grads[i].numel()).view(grads[i].sizes()));
        offset += grads[i].numel();
      }
      begin = end;
    }
  }
}

}  // namespace titan::dist
