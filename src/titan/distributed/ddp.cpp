#include "titan/distributed/ddp.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace titan::dist {

struct DDP::Bucket {
  DDP* ddp;
  std::vector<at::Tensor> params;
  size_t ready = 0;
  at::Tensor flat;
  Work work;
  bool in_flight = false;

  void on_grad_ready() {
    if (!ddp->sync_ || ++ready < params.size()) return;
    all_reduce();
    if (ddp->gradients_ready_)  // the buckets issued before this one are final (the others still fill)
      for (auto& b : ddp->buckets_)
        if (b.get() != this && b->in_flight) b->finish();
  }

  // Flattens the bucket's gradients and issues their all-reduce.
  void all_reduce() {
    std::vector<at::Tensor> grads;
    for (auto& p : params) grads.push_back(p.grad().reshape({-1}));
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
      p.mutable_grad().copy_(flat.slice(0, offset, offset + n).view(p.sizes()));
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

void DDP::finish_backward() {
  for (auto& b : buckets_) b->finish();
}

void DDP::all_reduce_now() {
  at::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    b->finish();  // anything a synced backward left in flight
    for (auto& p : b->params)
      if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    b->all_reduce();
  }
  for (auto& b : buckets_) b->finish();
}

}  // namespace titan::dist
