#include "titan/distributed/placement.h"

#include "titan/common/error.h"
#include "titan/common/grad_norm.h"
#include "titan/common/tensor_storage.h"
#include "titan/distributed/mesh.h"

#include <ATen/ATen.h>

#include <map>

namespace titan::dist {

std::vector<int64_t> Placement::global_begin() const {
  std::vector<int64_t> begin(global_shape.size(), 0);
  for (const auto& s : shards) begin[s.tensor_dim] += s.offset;
  return begin;
}

std::vector<int64_t> Placement::global_length() const {
  std::vector<int64_t> length = global_shape;
  for (const auto& s : shards) length[s.tensor_dim] = s.length;
  return length;
}

at::Tensor Placement::real_part(const at::Tensor& local) const {
  // The local tensor's extent along a dimension is that of the last shard that split it (TP's shard
  // split again by FSDP): its real entries are that shard's length.
  at::Tensor t = local;
  std::vector<bool> done(global_shape.size() + 1, false);
  for (size_t i = shards.size(); i-- > 0;) {
    const Shard& s = shards[i];
    if (done[static_cast<size_t>(s.tensor_dim)]) continue;
    done[static_cast<size_t>(s.tensor_dim)] = true;
    t = t.narrow(s.tensor_dim, 0, s.length);
  }
  // A 0-dim tensor is sharded as one row.
  return global_shape.empty() && t.numel() == 1 ? t.reshape({}) : t;
}

int64_t Placement::real_numel() const {
  int64_t n = 1;
  for (int64_t l : global_length()) n *= l;
  return n;
}

Placement whole(const at::Tensor& t, std::vector<std::string> replicated, bool primary) {
  Placement p;
  p.global_shape = t.sizes().vec();
  p.replicated = std::move(replicated);
  p.primary = primary;
  return p;
}

Placement compose(const Placement& outer, const Placement& inner) {
  Placement p = outer;
  p.shards.insert(p.shards.end(), inner.shards.begin(), inner.shards.end());
  p.replicated.insert(p.replicated.end(), inner.replicated.begin(), inner.replicated.end());
  p.primary = outer.primary && inner.primary;
  return p;
}

Shard chunk(const std::string& mesh_dim, int64_t tensor_dim, int64_t size, int rank, int n) {
  Shard s;
  s.mesh_dim = mesh_dim;
  s.tensor_dim = tensor_dim;
  s.local_size = (size + n - 1) / n;
  s.offset = std::min(size, rank * s.local_size);
  s.length = std::min(size, (rank + 1) * s.local_size) - s.offset;
  return s;
}

Placement shard_in_place(at::Tensor& param, int64_t dim, const std::string& mesh_dim, int rank, int n) {
  Placement p;
  p.global_shape = param.sizes().vec();
  const Shard s = chunk(mesh_dim, dim, param.size(dim), rank, n);
  TITAN_ASSERT(s.length == s.local_size, mesh_dim, ": dim ", dim, " of ", param.sizes(), " does not divide by ", n);
  p.shards.push_back(s);
  at::NoGradGuard no_grad;
  if (has_storage(param)) {
    param.set_data(param.narrow(dim, s.offset, s.length).clone(at::MemoryFormat::Contiguous));
  } else {  // built without memory: the shard's shape only, filled when materialized
    std::vector<int64_t> shape = p.global_shape;
    shape[dim] = s.length;
    at::Tensor holder = at::empty({0}, param.options());
    holder.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
    param.set_data(holder);
  }
  return p;
}

namespace {

// The groups whose members hold different pieces of `p` (their sums must be added up).
std::vector<std::string> shard_groups(const Placement& p) {
  std::vector<std::string> out;
  for (const auto& s : p.shards)
    if (std::find(out.begin(), out.end(), s.mesh_dim) == out.end()) out.push_back(s.mesh_dim);
  std::sort(out.begin(), out.end());
  return out;
}

// norms: each parameter's gradient norm, taken earlier (fp64 0-dim, undefined where it had no
// gradient), instead of the gradients.
at::Tensor total_norm(const std::vector<PlacedTensor>& params, Mesh& mesh, std::vector<at::Tensor>& grads,
                      const at::Tensor& poison = {}, const std::vector<std::string>& sum_over = {},
                      const std::vector<at::Tensor>* norms = nullptr) {
  // Gradients grouped by the set of groups they are sharded over; each group's sum of squares is
  // all-reduced over those groups (a replicated gradient counts once, as its copies are equal).
  std::map<std::vector<std::string>, std::vector<at::Tensor>> by_groups;
  for (size_t i = 0; i < params.size(); ++i) {
    const PlacedTensor& p = params[i];
    const at::Tensor g = norms ? (*norms)[i] : p.local.grad();
    if (!g.defined()) continue;
    grads.push_back(g);
    by_groups[shard_groups(p.placement)].push_back(g);  // padding gradients are zero
  }
  at::Tensor sum_sq;
  for (auto& [groups, gs] : by_groups) {
    // (the norms: their squares added up as grad_sum_of_squares adds the gradients' norms')
    at::Tensor s = (norms ? at::stack(gs).square().sum() : grad_sum_of_squares(gs)).to(mesh.device());  // CPU-offloaded gradients, NCCL groups
    if (poison.defined()) s = s + poison.to(s.device(), s.scalar_type());  // 0, or inf: spread by the reductions
    for (const auto& name : groups) mesh[name].all_reduce(s).wait();
    sum_sq = sum_sq.defined() ? sum_sq + s : s;
  }
  if (!sum_sq.defined()) sum_sq = poison.defined() ? poison.to(at::kDouble) : at::zeros({}, at::kDouble);
  if (!sum_over.empty()) sum_sq = sum_sq.to(mesh.device(), at::kDouble).contiguous();
  for (const auto& name : sum_over) mesh[name].all_reduce(sum_sq).wait();
  return sum_sq.sqrt();
}

}  // namespace

double global_grad_norm(const std::vector<PlacedTensor>& params, Mesh& mesh) {
  std::vector<at::Tensor> grads;
  return total_norm(params, mesh, grads).item<double>();
}

std::pair<at::Tensor, at::Tensor> grad_norm_and_clip_divisor(const std::vector<PlacedTensor>& params, double max_norm,
                                                             Mesh& mesh, const at::Tensor& poison,
                                                             const std::vector<std::string>& sum_over) {
  std::vector<at::Tensor> grads;
  at::Tensor total = total_norm(params, mesh, grads, poison, sum_over);
  return {total, clip_divisor(total, max_norm)};
}

at::Tensor grad_norm_of(const std::vector<PlacedTensor>& params, const std::vector<at::Tensor>& norms, Mesh& mesh,
                        const at::Tensor& poison, const std::vector<std::string>& sum_over) {
  TITAN_ASSERT(norms.size() == params.size(), "grad_norm_of: one norm per parameter");
  std::vector<at::Tensor> unused;
  return total_norm(params, mesh, unused, poison, sum_over, &norms);
}

at::Tensor gather_full(const PlacedTensor& t, Mesh& mesh) {
  at::NoGradGuard no_grad;
  const Placement& p = t.placement;
  at::Tensor cur = t.local.detach();
  if (cur.dim() == 0 && !p.shards.empty()) cur = cur.view({1});
  // Undo the shards from the last applied to the first: all-gather the padded chunks, concatenate
  // them along the split dimension and drop the padding (the size that shard split).
  for (size_t i = p.shards.size(); i-- > 0;) {
    const Shard& s = p.shards[i];
    int64_t size_before = p.global_shape.empty() ? 1 : p.global_shape[s.tensor_dim];
    for (size_t j = 0; j < i; ++j)
      if (p.shards[j].tensor_dim == s.tensor_dim) size_before = p.shards[j].length;
    Group& g = mesh[s.mesh_dim];
    at::Tensor in = cur.contiguous();
    at::Tensor buf = at::empty({g.size() * in.numel()}, in.options());
    g.all_gather(buf, in).wait();
    std::vector<int64_t> shape = in.sizes().vec();
    shape.insert(shape.begin(), g.size());
    at::Tensor pieces = buf.view(shape);
    cur = at::cat(pieces.unbind(0), s.tensor_dim).narrow(s.tensor_dim, 0, size_before);
  }
  return cur.reshape(p.global_shape);
}

}  // namespace titan::dist
