#include "titan/distributed/fsdp.h"

#include "titan/common/error.h"
#include "titan/common/tensor_storage.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <set>

namespace titan::dist {
namespace {

// A tensor over `t`'s storage with its own version counter: writing through it does not look like an
// in-place change of `t` to autograd (the values written are the ones `t` had in forward).
at::Tensor storage_alias(const at::Tensor& t) {
  return at::empty({0}, t.options()).set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
}

int64_t row_elems(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t d = 1; d < shape.size(); ++d) n *= shape[d];
  return n;
}

}  // namespace

struct FSDP::Unit {
  struct Param {
    std::string name;
    at::Tensor full;   // the module's parameter, param_dtype; storage only while unsharded
    at::Tensor shard;  // (shard_rows, ...) fp32 leaf
    std::vector<int64_t> shape;
    int64_t rows = 0, shard_rows = 0;
    at::Tensor gather_buf;
    Work gather;
    struct Pending {
      Work work;
      at::Tensor input, output;
    };
    std::vector<Pending> reductions;
  };

  FSDP* fsdp;
  std::string prefix;
  bool reshard_after_forward;
  std::vector<Param> params;
  enum class State { Sharded, Gathering, Unsharded } state = State::Sharded;
  int grads_ready = 0;
  Unit* next_forward = nullptr;   // unit whose parameters the forward needs next
  Unit* next_backward = nullptr;  // unit whose parameters the backward needs next

  Group& group() { return fsdp->shard_; }

  void start_unshard() {
    if (state != State::Sharded) return;
    const int n = group().size();
    for (auto& p : params) {
      p.gather_buf = at::empty({n * p.shard.numel()}, p.shard.options().dtype(fsdp->options_.param_dtype));
      at::Tensor local = p.shard.detach().to(fsdp->options_.param_dtype);
      p.gather = group().all_gather(p.gather_buf, local);
    }
    state = State::Gathering;
  }

  void finish_unshard() {
    if (state == State::Unsharded) return;
    start_unshard();
    at::NoGradGuard no_grad;
    for (auto& p : params) {
      p.gather.wait();
      allocate_storage(p.full);
      storage_alias(p.full).copy_(p.gather_buf.view({-1}).slice(0, 0, p.full.numel()).view(p.full.sizes()));
      p.gather_buf.reset();
    }
    state = State::Unsharded;
  }

  void reshard() {
    if (state == State::Gathering) finish_unshard();  // never leave a collective in flight
    for (auto& p : params) free_storage(p.full);
    state = State::Sharded;
  }

  void pre_forward() {
    finish_unshard();
    if (next_forward) next_forward->start_unshard();
  }

  at::Tensor post_forward(const at::Tensor& out) {
    if (reshard_after_forward) reshard();
    if (out.requires_grad()) {
      Unit* self = this;
      out.register_hook([self](at::Tensor grad) {
        self->pre_backward();
        return grad;
      });
    }
    return out;
  }

  void pre_backward() {
    finish_unshard();
    if (next_backward) next_backward->start_unshard();
  }

  void on_grad_ready() {
    if (++grads_ready == static_cast<int>(params.size())) reduce_grads();
  }

  // Casts each full gradient to reduce_dtype, pads it to N * shard_rows rows and reduce-scatters it;
  // the full gradients and parameters are freed. The reductions of the unit before are completed
  // first, so at most one unit's padded full-size gradients are alive at a time while this unit's
  // reduce-scatter overlaps the next unit's backward.
  void reduce_grads() {
    for (auto& other : fsdp->units_)
      if (other.get() != this) other->complete_reductions();
    const int n = group().size();
    for (auto& p : params) {
      at::Tensor g = p.full.grad();
      if (!g.defined()) continue;
      at::Tensor input = at::zeros({n * p.shard_rows * row_elems(p.shape)}, g.options().dtype(fsdp->options_.reduce_dtype));
      input.slice(0, 0, g.numel()).copy_(g.reshape({-1}));
      at::Tensor output = at::empty({p.shard.numel()}, input.options());
      Work w = group().reduce_scatter(output, input);
      p.reductions.push_back({std::move(w), input, output});
      p.full.mutable_grad() = at::Tensor();
    }
    int64_t pending = 0;
    for (auto& u : fsdp->units_)
      for (auto& p : u->params)
        for (auto& r : p.reductions) pending += r.input.numel() * r.input.element_size();
    fsdp->peak_reduction_bytes_ = std::max(fsdp->peak_reduction_bytes_, pending);
    grads_ready = 0;
    reshard();
  }

  void finish_reductions() {
    if (grads_ready > 0) reduce_grads();  // some parameters took no part in this backward
    complete_reductions();
  }

  // Waits for this unit's reduce-scatters (and, with HSDP, all-reduces the shards over replicas),
  // adds them to the shards' gradients and drops the full-size buffers.
  void complete_reductions() {
    for (auto& p : params) {
      for (auto& r : p.reductions) {
        r.work.wait();
        if (fsdp->replicate_) fsdp->replicate_->all_reduce(r.output).wait();
        at::Tensor g = r.output.view(p.shard.sizes()).to(at::kFloat);
        if (p.shard.grad().defined())
          p.shard.mutable_grad().add_(g);
        else
          p.shard.mutable_grad() = g.clone();
      }
      p.reductions.clear();
    }
  }
};

namespace {

struct GradReadyHook : torch::autograd::PostAccumulateGradHook {
  FSDP::Unit* unit;
  explicit GradReadyHook(FSDP::Unit* u) : unit(u) {}
  void operator()(const torch::autograd::Variable&) override { unit->on_grad_ready(); }
};

}  // namespace

FSDP::FSDP(Group& shard, Group* replicate, FSDPOptions options)
    : shard_(shard), replicate_(replicate && replicate->size() > 1 ? replicate : nullptr), options_(std::move(options)) {
  const auto& r = options_.reshard_after_forward;
  TITAN_USER_CHECK(r == "default" || r == "always" || r == "never", "parallelism.fsdp_reshard_after_forward '", r,
                   "' is not one of default, always, never");
}

FSDP::~FSDP() {
  for (auto& u : units_)
    for (auto& p : u->params) torch::autograd::impl::set_post_acc_grad_hooks(p.full, nullptr);
}

void FSDP::fully_shard(nn::HookedModule& module, const std::string& prefix, const std::function<void()>& init) {
  std::set<const void*> owned;
  for (const auto& u : units_)
    for (const auto& p : u->params) owned.insert(p.full.unsafeGetTensorImpl());
  // Parameters built without storage (DeferAllocation) get it now, this unit only, and their values.
  bool materialized = false;
  for (const auto& item : module.named_parameters()) {
    if (owned.count(item.value().unsafeGetTensorImpl()) || has_storage(item.value())) continue;
    allocate_storage(item.value());
    materialized = true;
  }
  if (materialized) {
    TITAN_ASSERT(init, "fully_shard of '", prefix, "': parameters without values and no init function");
    init();
  }
  auto unit = std::make_unique<Unit>();
  unit->fsdp = this;
  unit->prefix = prefix;
  const bool is_root = prefix.empty();
  unit->reshard_after_forward =
      options_.reshard_after_forward == "always" || (options_.reshard_after_forward == "default" && !is_root);
  const int n = shard_.size(), k = shard_.rank();
  at::NoGradGuard no_grad;
  for (const auto& item : module.named_parameters()) {
    at::Tensor full = item.value();
    if (owned.count(full.unsafeGetTensorImpl())) continue;
    TITAN_ASSERT(has_storage(full) && full.scalar_type() == at::kFloat, "fully_shard needs fp32 parameters with values");
    Unit::Param p;
    p.name = prefix + item.key();
    p.shape = full.sizes().vec();
    p.rows = p.shape.empty() ? 1 : p.shape[0];
    p.shard_rows = (p.rows + n - 1) / n;  // torch.chunk's rows per rank; the last ranks may hold padding
    std::vector<int64_t> shard_shape = p.shape.empty() ? std::vector<int64_t>{1} : p.shape;
    shard_shape[0] = p.shard_rows;
    p.shard = at::zeros(shard_shape, full.options());
    const int64_t begin = std::min(p.rows, k * p.shard_rows), end = std::min(p.rows, (k + 1) * p.shard_rows);
    if (end > begin) p.shard.slice(0, 0, end - begin).copy_(full.reshape({p.rows, -1}).slice(0, begin, end).view(
                         [&] { auto s = shard_shape; s[0] = end - begin; return s; }()));
    p.shard.requires_grad_(true);
    // The module's parameter becomes the param_dtype holder of the full tensor, without storage.
    full.set_data(at::empty(p.shape, full.options().dtype(options_.param_dtype)));
    free_storage(full);
    p.full = full;
    torch::autograd::impl::set_post_acc_grad_hooks(full, std::make_unique<GradReadyHook>(unit.get()));
    unit->params.push_back(std::move(p));
  }
  Unit* u = unit.get();
  module.add_forward_pre_hook([u] { u->pre_forward(); });
  module.add_forward_hook([u](const at::Tensor& out) { return u->post_forward(out); });
  units_.push_back(std::move(unit));
  if (!is_root) return;
  // Execution order: the root's forward starts first and its backward (the output layer) first;
  // the inner units run in the order they were sharded.
  const size_t inner = units_.size() - 1;
  for (size_t i = 0; i < inner; ++i) {
    units_[i]->next_forward = i + 1 < inner ? units_[i + 1].get() : nullptr;
    units_[i]->next_backward = i > 0 ? units_[i - 1].get() : nullptr;
  }
  u->next_forward = inner > 0 ? units_[0].get() : nullptr;
  u->next_backward = inner > 0 ? units_[inner - 1].get() : nullptr;
}

std::vector<std::pair<std::string, at::Tensor>> FSDP::sharded_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& u : units_)
    for (const auto& p : u->params) out.emplace_back(p.name, p.shard);
  return out;
}

void FSDP::finish_backward() {
  for (auto& u : units_) u->finish_reductions();
}

std::vector<PlacedTensor> FSDP::placed_parameters() const {
  std::vector<PlacedTensor> out;
  for (const auto& u : units_) {
    for (const auto& p : u->params) {
      TITAN_ASSERT(!p.shape.empty(), "FSDP placement of 0-dim parameter ", p.name);
      Placement pl;
      pl.global_shape = p.shape;
      pl.shards.push_back(chunk(shard_.name(), 0, p.rows, shard_.rank(), shard_.size()));
      if (replicate_) pl.replicated.push_back(replicate_->name());
      pl.primary = !replicate_ || replicate_->rank() == 0;
      out.push_back({p.name, p.shard, std::move(pl)});
    }
  }
  return out;
}

}  // namespace titan::dist
