#include "titan/distributed/ddp.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace titan::dist {

struct DDP::Bucket {
  DDP* ddp;
  std::vector<at::Tensor> params;
  size_t ready = 0;  // gradients accumulated in this backward (all: the bucket can be issued)
  at::Tensor flat;
  Work work;
  bool in_flight = false;

  void on_grad_ready() {
    if (!ddp->sync_ || ++ready < params.size()) return;
    ddp->issue_ready_buckets();
  }

  // Flattens the bucket's gradients (missing ones as zeros: a parameter this rank's forward did not
  // use, whose gradient is then the other ranks' sum) and issues their all-reduce.
  void all_reduce() {
    std::vector<at::Tensor> grads;
    for (auto& p : params) grads.push_back(p.grad().defined() ? p.grad().reshape({-1}) : at::zeros({p.numel()}, p.options()));
    flat = at::cat(grads);
    work = ddp->group_.all_reduce(flat);
    in_flight = true;
  }

  void finish() {
    if (!in_flight) {
      ready = 0;
      return;
    }
    work.wait();
    int64_t offset = 0;
    for (auto& p : params) {
      const int64_t n = p.numel();
      const at::Tensor summed = flat.slice(0, offset, offset + n).view(p.sizes());
      if (p.grad().defined())
        p.mutable_grad().copy_(summed);
      else  // unused by this rank's forward: the other ranks' sum
        p.mutable_grad() = summed.clone();
      offset += n;
    }
    flat.reset();
    in_flight = false;
    ready = 0;
    if (ddp->gradients_ready_) ddp->gradients_ready_(params);
  }
};

namespace {
struct BucketHook : torch::autograd::PostAccumulateGradHook {
  DDP::Bucket* bucket;
  explicit BucketHook(DDP::Bucket* b) : bucket(b) {}
  void operator()(const torch::autograd::Variable&) override { bucket->on_grad_ready(); }
};
}  // namespace

DDP::DDP(const std::vector<std::pair<std::string, at::Tensor>>& params, Group& replicate, int64_t bucket_bytes)
    : group_(replicate) {
  int64_t bytes = bucket_bytes;
  for (auto it = params.rbegin(); it != params.rend(); ++it) {
    const at::Tensor& p = it->second;
    const int64_t nbytes = p.numel() * p.element_size();
    if (buckets_.empty() || bytes + nbytes > bucket_bytes) {
      buckets_.push_back(std::make_unique<Bucket>());
      buckets_.back()->ddp = this;
      bytes = 0;
    }
    bytes += nbytes;
    buckets_.back()->params.push_back(p);
    params_.push_back(p);
    torch::autograd::impl::set_post_acc_grad_hooks(p, std::make_unique<BucketHook>(buckets_.back().get()));
  }
}

DDP::~DDP() {
  for (auto& p : params_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
}

void DDP::issue(Bucket& bucket) {
  bucket.all_reduce();
  ++next_bucket_;
  if (gradients_ready_)  // the buckets issued before this one are final (the others still fill)
    for (auto& b : buckets_)
      if (b.get() != &bucket && b->in_flight) b->finish();
}

void DDP::issue_ready_buckets() {
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_]->ready >= buckets_[next_bucket_]->params.size())
    issue(*buckets_[next_bucket_]);
}

void DDP::finish_backward() {
  // Buckets left (a parameter this rank did not use): issued now, still in bucket order.
  at::NoGradGuard no_grad;
  while (next_bucket_ < buckets_.size()) issue(*buckets_[next_bucket_]);
  for (auto& b : buckets_) b->finish();
  next_bucket_ = 0;
}

void DDP::all_reduce_now() {
  at::NoGradGuard no_grad;
  next_bucket_ = 0;
  for (auto& b : buckets_) {
    b->finish();  // anything a synced backward left in flight
    for (auto& p : b->params)
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    b->all_reduce();
  }
  for (auto& b : buckets_) b->finish();
}

}  // namespace titan::dist
