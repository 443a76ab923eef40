#include "titan/distributed/mesh.h"

#include "titan/common/error.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

namespace titan::dist {

void Work::wait() {
  if (work_) work_->wait();
  work_.reset();
}

Group::Group(std::string name, std::vector<int> ranks, int rank, c10::intrusive_ptr<c10d::Backend> backend,
             CommBytes* bytes, CommBytes* calls)
    : name_(std::move(name)), ranks_(std::move(ranks)), rank_(rank), backend_(std::move(backend)), bytes_(bytes),
      calls_(calls) {}

void Group::count(const char* op, const at::Tensor& t) {
  if (size() <= 1) return;
  (*bytes_)[name_][op] += static_cast<int64_t>(t.numel() * t.element_size());
  (*calls_)[name_][op] += 1;
}

Work Group::all_gather(at::Tensor& out, const at::Tensor& in) {
  TITAN_ASSERT(out.is_contiguous() && out.numel() == in.numel() * size(), "all_gather: output must hold size x input");
  count("all_gather", out);
  if (size() == 1) {
    out.view(in.sizes()).copy_(in);
    return Work();
  }
  // Flat views: backends expect the output to stack `size` copies of the input's shape.
  at::Tensor src = in.contiguous().view({-1}), dst = out.view({-1});
  return Work(backend_->_allgather_base(dst, src));
}

Work Group::reduce_scatter(at::Tensor& out, const at::Tensor& in) {
  TITAN_ASSERT(in.is_contiguous() && in.numel() == out.numel() * size(), "reduce_scatter: input must hold size x output");
  count("reduce_scatter", in);
  if (size() == 1) {
    out.copy_(in.view(out.sizes()));
    return Work();
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  at::Tensor src = in.view({-1}), dst = out.view({-1});
  return Work(backend_->_reduce_scatter_base(dst, src, opts));
}

Work Group::all_reduce(at::Tensor& t, c10d::ReduceOp op) {
  count("all_reduce", t);
  if (size() == 1) return Work();
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  return Work(backend_->allreduce(ts, opts));
}

Work Group::broadcast(at::Tensor& t, int root) {
  count("broadcast", t);
  if (size() == 1) return Work();
  std::vector<at::Tensor> ts{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  return Work(backend_->broadcast(ts, opts));
}

void Group::barrier() {
  if (size() > 1) backend_->barrier()->wait();
}

void Group::set_timeout(std::chrono::milliseconds timeout) {
  if (backend_) backend_->setTimeout(timeout);
}

void Mesh::set_timeout(std::chrono::milliseconds timeout) {
  for (auto& [name, group] : groups_) group->set_timeout(timeout);
}

Mesh::Mesh(const ParallelDims& dims, int rank, const c10::intrusive_ptr<c10d::Store>& store, BackendKind backend,
           std::chrono::milliseconds timeout, const std::string& gloo_host)
    : dims_(dims), rank_(rank), backend_(backend) {
  const std::vector<std::string> names = {"pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp",
                                          "dp_cp", "world"};
  // Dimensions with the same members (e.g. dp_shard, dp and world under plain FSDP) share one
  // backend; each keeps its own name for the byte counts.
  std::map<std::vector<int>, c10::intrusive_ptr<c10d::Backend>> by_members;
  for (const auto& name : names) {
    std::vector<int> ranks = dims_.group_ranks(name, rank);
    c10::intrusive_ptr<c10d::Backend>& b = by_members[ranks];
    if (ranks.size() > 1 && !b) {
      // Each group rendezvouses under its own prefix: its name and its first member.
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name + "/" + std::to_string(ranks[0]), store);
      b = make_backend(backend, prefixed, dims_.rank_in(name, rank), static_cast<int>(ranks.size()), timeout, gloo_host);
    }
    groups_[name] = std::make_unique<Group>(name, ranks, dims_.rank_in(name, rank), b, &bytes_, &calls_);
  }
}

at::Device Mesh::device() const {
  if (backend_ != BackendKind::NCCL) return at::Device(at::kCPU);
  return at::Device(at::kCUDA, c10::impl::getDeviceGuardImpl(at::kCUDA)->getDevice().index());
}

Group& Mesh::operator[](const std::string& name) {
  auto it = groups_.find(name);
  TITAN_ASSERT(it != groups_.end(), "no mesh dimension '", name, "'");
  return *it->second;
}

}  // namespace titan::dist
