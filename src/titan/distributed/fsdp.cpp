#include "titan/distributed/fsdp.h"

#include "titan/common/error.h"
#include "titan/common/tensor_storage.h"
#include "titan/common/trace.h"
#include "titan/nn/activation_checkpoint.h"
#include "titan/nn/float8.h"
#include "titan/nn/layers.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/cuda.h>

#include <set>

namespace titan::dist {
namespace {

// A tensor over `t`'s storage with its own version counter: writing through it does not look like an
// in-place change of `t` to autograd (the values written are the ones `t` had in forward).
at::Tensor storage_alias(const at::Tensor& t) {
  return at::empty({0}, t.options()).set_(t.storage(), t.storage_offset(), t.sizes(), t.strides());
}

// Points `t`'s storage (contiguous, offset 0) at `count` elements of `buffer` starting at `offset`,
// without owning them: the buffer must outlive the use (free_storage undoes it).
void borrow_storage(const at::Tensor& t, const at::Tensor& buffer, int64_t offset) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  char* data = static_cast<char*>(buffer.data_ptr()) + offset * buffer.element_size();
  s->set_data_ptr_noswap(at::DataPtr(data, buffer.device()));
  s->set_nbytes(static_cast<size_t>(t.numel()) * t.element_size());
}

int64_t row_elems(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t d = 1; d < shape.size(); ++d) n *= shape[d];
  return n;
}

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// The tensorwise recipe's weight scales from whole-weight amaxes (nn::float8_cast's formula).
at::Tensor e4m3_scales(const at::Tensor& amax) { return nn::float8_scale(amax, nn::Float8Type::E4M3, false); }

// A tensor of `shape` and `options` without memory (its storage is borrowed while in use).
at::Tensor holder(const std::vector<int64_t>& shape, const at::TensorOptions& options) {
  at::Tensor t = at::empty({0}, options);
  t.unsafeGetTensorImpl()->set_sizes_contiguous(shape);
  return t;
}

}  // namespace

struct FSDP::Unit {
  struct Param {
    std::string name;
    at::Tensor full;   // the module's parameter, param_dtype; storage only while unsharded
    at::Tensor shard;  // (shard_rows, ...) fp32 leaf over flat_shard
    std::vector<int64_t> shape;
    int64_t rows = 0, shard_rows = 0, row = 0;  // row: elements per row
    int64_t offset = 0;       // of the shard in flat_shard (and of each rank's piece in a gathered buffer)
    int64_t full_offset = 0;  // of the full parameter in full_buf (a float8-gathered weight: in full8_buf)
    // Float8 all-gather: the layer's float8 weight, whose data borrows full8_buf while unsharded (the
    // param_dtype `full` then never holds memory), and the all-reduce its amax needs under TP.
    std::shared_ptr<nn::Float8Weight> fp8;
    const std::function<void(at::Tensor&)>* tp_max = nullptr;
    int64_t gather_offset = 0;  // bytes, in each rank's piece of a unit's byte all-gather
  };

  FSDP* fsdp;
  std::string prefix;
  bool reshard_after_forward = true;
  std::vector<Param> params;
  int64_t shard_numel = 0, full_numel = 0;
  // Float8 all-gather: a unit with float8-gathered weights gathers bytes, gather_bytes per rank (0:
  // the unit gathers in param_dtype); full8_numel: its float8 weights' elements.
  int64_t gather_bytes = 0, full8_numel = 0, num_fp8 = 0;
  at::Tensor full8_buf;           // pooled, e4m3, while unsharded
  at::Tensor precomputed_scales;  // (num_fp8) fp32 from precompute_float8_scales; undefined: from the gathers
  // The scales the unit's first gather of a forward and backward computed, for its later gathers (the
  // weights change only in the optimizer step, after a synced backward, which drops them).
  at::Tensor step_scales;
  at::Device device{at::kCPU};  // where the unit computes (the modules' device)
  at::Tensor flat_shard;        // fp32, shard_numel, on the device or (offload) the CPU
  // The shards' gradients are views of one fp32 buffer of the same layout (the flat gradient),
  // allocated by a step's first reduction and not held by the unit: the optimizer's zero_grad (set
  // to none) frees it, so no gradient memory is held through the next forward (as FSDP2's sharded
  // gradients).
  bool final_pending = false;  // a final backward's gradients landed after a host copy still in flight

  enum class State { Sharded, Gathering, Unsharded } state = State::Sharded;
  at::Tensor gather_in, gather_out, full_buf;  // pooled (gather_in is flat_shard itself when no cast/copy is needed)
  bool gather_in_pooled = false;
  Work gather;

  at::Tensor rs_in, rs_out;  // pooled
  Work reduce_scatter, all_reduce;
  bool reducing = false, all_reducing = false;
  int grads_ready = 0;
  bool reduced = false;  // in the current backward

  Unit* next_forward = nullptr;   // unit whose parameters the forward needs next
  Unit* next_backward = nullptr;  // unit whose parameters the backward needs next
  Unit* backward_before = nullptr;  // inner unit whose backward ends where this one's begins

  Group& group() { return fsdp->shard_; }
  const FSDPOptions& options() const { return fsdp->options_; }
  int64_t padded_numel() { return group().size() * shard_numel; }

  // Each rank's piece of a gathered (or to-be-scattered) buffer of this unit: (N, shard_rows, row).
  at::Tensor pieces(const at::Tensor& buffer, const Param& p) {
    const int64_t n = group().size();
    return buffer.view({n, shard_numel}).slice(1, p.offset, p.offset + p.shard_rows * p.row).view({n, p.shard_rows, p.row});
  }

  // rows (R, row) <-> pieces (N, s, row): the first R of the N·s padded rows, as two copies whatever
  // N (the ranks' whole pieces as one (R / s, s, row) block, then the part of the next rank's), not
  // one per rank: a small weight on a large shard group would otherwise cost N kernels per pass.
  // copy(rows_part, pieces_part) is called with views of equal shape.
  static void copy_rows(const Param& p, const at::Tensor& rows, const at::Tensor& pieces,
                        const std::function<void(const at::Tensor&, const at::Tensor&)>& copy) {
    if (p.shard_rows == 0) return;
    const int64_t whole = p.rows / p.shard_rows, rest = p.rows - whole * p.shard_rows;
    if (whole > 0)
      copy(rows.slice(0, 0, whole * p.shard_rows).view({whole, p.shard_rows, p.row}), pieces.slice(0, 0, whole));
    if (rest > 0) copy(rows.slice(0, whole * p.shard_rows, p.rows), pieces[whole].slice(0, 0, rest));
  }

  // The unit's name in traces: its module prefix without the final dot ("layers.0"), "root" for the
  // outermost unit.
  std::string label() const { return prefix.empty() ? "root" : prefix.substr(0, prefix.size() - (prefix.back() == '.')); }

  // Float8 all-gather: each float8-gathered weight's shard amax, (num_fp8) fp32 on the device.
  at::Tensor local_amaxes() {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> amax;
    for (const auto& p : params)
      if (p.fp8) amax.push_back(p.shard.abs().amax());
    return at::stack(amax).to(device, at::kFloat);
  }

  // Completes `amax` (the unit's float8 weights' local amaxes, or several units') into whole-weight
  // amaxes: the maximum over the shard group and, when the weights are TP-split, the TP group.
  static void max_over_ranks(at::Tensor& amax, Group& shard, const std::function<void(at::Tensor&)>* tp_max) {
    if (shard.size() > 1) shard.all_reduce(amax, c10d::ReduceOp::MAX).wait();
    if (tp_max) (*tp_max)(amax);
  }
  const std::function<void(at::Tensor&)>* tp_max() const {
    for (const auto& p : params)
      if (p.tp_max) return p.tp_max;
    return nullptr;
  }

  // The byte view of parameter p's part of a rank's piece (or of every rank's pieces: (N, bytes)) of
  // a byte all-gather buffer, as p's gather dtype.
  at::Tensor byte_piece(const at::Tensor& buffer, const Param& p) {
    const at::ScalarType dtype = p.fp8 ? at::kFloat8_e4m3fn : options().param_dtype;
    const int64_t bytes = p.shard_rows * p.row * c10::elementSize(dtype);
    return buffer.view({-1, gather_bytes}).slice(1, p.gather_offset, p.gather_offset + bytes).view(dtype);
  }

  // Float8 all-gather: the shards into one byte buffer (float8 weights cast with their whole-weight
  // scales, the others in param_dtype), all-gathered.
  void start_byte_unshard() {
    at::Tensor scales = precomputed_scales.defined() ? precomputed_scales : step_scales;
    if (!scales.defined()) {
      at::Tensor amax = local_amaxes();
      max_over_ranks(amax, group(), tp_max());
      scales = step_scales = e4m3_scales(amax);
    }
    gather_in_pooled = true;
    gather_in = fsdp->acquire(gather_bytes, at::kByte, device);
    int64_t i = 0;
    for (auto& p : params) {
      at::Tensor dst = byte_piece(gather_in, p).view(-1);
      const at::Tensor shard = p.shard.reshape(-1).to(device, /*non_blocking=*/true);
      if (p.fp8) {
        const at::Tensor scale = scales[i++];
        p.fp8->scale.copy_(scale);
        dst.copy_(nn::float8_data(shard, scale, nn::Float8Type::E4M3));
      } else {
        dst.copy_(shard);
      }
    }
    gather_out = fsdp->acquire(padded_gather_bytes(), at::kByte, device);
    gather = group().all_gather(gather_out, gather_in);
    state = State::Gathering;
  }
  int64_t padded_gather_bytes() { return group().size() * gather_bytes; }

  // Copies the gathered pieces (N, shard_rows, row) of parameter p into its full rows `dst` (R, row).
  void copy_out(const Param& p, const at::Tensor& dst, const at::Tensor& src) {
    const int64_t n = group().size();
    if (p.rows == n * p.shard_rows) {
      dst.view({n, p.shard_rows, p.row}).copy_(src);
    } else {
      copy_rows(p, dst, src, [](const at::Tensor& rows, const at::Tensor& piece) { rows.copy_(piece); });
    }
  }

  void start_unshard() {
    if (state != State::Sharded) return;
    TraceRange range(mem::Phase::Communication, "FSDP::all_gather (", label(), ")");
    at::NoGradGuard no_grad;
    if (gather_bytes > 0) return start_byte_unshard();
    const at::ScalarType dtype = options().param_dtype;
    gather_in_pooled = !(flat_shard.device() == device && dtype == at::kFloat);
    if (gather_in_pooled) {
      gather_in = fsdp->acquire(shard_numel, dtype, device);
      gather_in.copy_(flat_shard, /*non_blocking=*/true);
    } else {
      gather_in = flat_shard;
    }
    gather_out = fsdp->acquire(padded_numel(), dtype, device);
    gather = group().all_gather(gather_out, gather_in);
    state = State::Gathering;
  }

  void finish_unshard() {
    if (state == State::Unsharded) return;
    start_unshard();
    TraceRange range(mem::Phase::Communication, "FSDP::all_gather_wait (", label(), ")");
    at::NoGradGuard no_grad;
    gather.wait();
    if (full_numel > 0) full_buf = fsdp->acquire(full_numel, options().param_dtype, device);
    // (from the byte buffers the gathers use: float8 elements are bytes)
    if (full8_numel > 0) full8_buf = fsdp->acquire(full8_numel, at::kByte, device).view(at::kFloat8_e4m3fn);
    const int64_t n = group().size();
    for (auto& p : params) {
      const at::Tensor& full = p.fp8 ? p.fp8->data : p.full;
      borrow_storage(full, p.fp8 ? full8_buf : full_buf, p.full_offset);
      const at::Tensor src = gather_bytes > 0 ? byte_piece(gather_out, p).view({n, p.shard_rows, p.row}) : pieces(gather_out, p);
      copy_out(p, storage_alias(full).view({p.rows, p.row}), src);
    }
    if (gather_in_pooled) fsdp->release(gather_in);
    gather_in.reset();
    fsdp->release(gather_out);
    state = State::Unsharded;
  }

  void reshard() {
    if (state == State::Gathering) finish_unshard();  // never leave a collective in flight
    if (state == State::Unsharded) {
      for (auto& p : params) free_storage(p.fp8 ? p.fp8->data : p.full);
      fsdp->release(full_buf);
      fsdp->release(full8_buf);
    }
    state = State::Sharded;
  }

  // A unit inside an activation-checkpointed body (a MoE layer's experts under expert parallelism)
  // also runs its forward when the body is recomputed in backward: it gathers then without
  // prefetching the next forward's unit, and stays gathered for the backward that follows.
  void pre_forward() {
    finish_unshard();
    if (next_forward && !nn::recomputing()) next_forward->start_unshard();
  }

  at::Tensor post_forward(const at::Tensor& out) {
    if (reshard_after_forward && !nn::recomputing()) reshard();
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
    // The unit whose backward came just before this one is done: every gradient it will get is
    // accumulated (gradient accumulation runs before the nodes that consume the same backward's
    // input gradients). If some parameter got none on this rank, it reduces now, at the same point
    // of the backward as on the ranks where its gradients were complete, so that every rank issues
    // the same collectives in the same order.
    if (backward_before && !fsdp->sync_gradients_ && options().reshard_after_backward)
      backward_before->reshard();  // gradients stay unreduced
    if (backward_before && fsdp->sync_gradients_ && !backward_before->reduced) backward_before->reduce_grads();
    finish_unshard();
    if (next_backward) next_backward->start_unshard();
  }

  void on_grad_ready() {
    if (!fsdp->sync_gradients_) return;  // accumulated in the full gradients until a synced backward
    if (++grads_ready == static_cast<int>(params.size()) && !reduced) reduce_grads();
  }

  // Lays every gradient out like the flat shards of all ranks (padding and missing gradients zero),
  // in reduce_dtype, and reduce-scatters it: one collective. The reductions of the unit before are
  // completed first (and, with HSDP, their all-reduce issued), so at most one unit's padded
  // full-size gradients are alive at a time while this unit's reduce-scatter overlaps the next
  // unit's backward. The full parameters and gradients are freed.
  void reduce_grads() {
    for (auto& other : fsdp->units_)
      if (other.get() != this) other->complete_reduce_scatter();
    TraceRange range(mem::Phase::Communication, "FSDP::reduce_scatter (", label(), ")");
    at::NoGradGuard no_grad;
    const int64_t n = group().size();
    rs_in = fsdp->acquire(padded_numel(), options().reduce_dtype, device);
    bool dense = true;
    for (const auto& p : params) dense = dense && p.full.grad().defined() && p.rows == n * p.shard_rows;
    if (!dense) rs_in.zero_();
    for (auto& p : params) {
      at::Tensor g = p.full.grad();
      if (!g.defined()) continue;  // took no part in this backward: its gradient is zero
      at::Tensor rows = g.reshape({p.rows, p.row}), dst = pieces(rs_in, p);
      if (p.rows == n * p.shard_rows) {
        dst.copy_(rows.view({n, p.shard_rows, p.row}));
      } else {
        copy_rows(p, rows, dst, [](const at::Tensor& rows, const at::Tensor& piece) { piece.copy_(rows); });
      }
      p.full.mutable_grad() = at::Tensor();
    }
    rs_out = fsdp->acquire(shard_numel, options().reduce_dtype, device);
    reduce_scatter = group().reduce_scatter(rs_out, rs_in);
    reducing = true;
    int64_t pending = 0;
    for (auto& u : fsdp->units_)
      if (u->reducing) pending += u->rs_in.numel() * u->rs_in.element_size();
    fsdp->peak_reduction_bytes_ = std::max(fsdp->peak_reduction_bytes_, pending);
    grads_ready = 0;
    reduced = true;
    reshard();
  }

  // Waits for this unit's reduce-scatter; with HSDP issues the all-reduce of the reduced shard over
  // replicas (waited for in finish_backward), else adds it to the gradients.
  void complete_reduce_scatter() {
    if (!reducing) return;
    TraceRange range(mem::Phase::Communication, "FSDP::reduce_scatter_wait (", label(), ")");
    reduce_scatter.wait();
    fsdp->release(rs_in);
    reducing = false;
    if (fsdp->replicate_) {
      all_reduce = fsdp->replicate_->all_reduce(rs_out);
      all_reducing = true;
    } else {
      accumulate();
    }
  }

  void complete_all_reduce() {
    if (!all_reducing) return;
    all_reduce.wait();
    all_reducing = false;
    accumulate();
  }

  // The flat gradient the shards' gradients view, when they all still view one such buffer (an
  // earlier reduction of this step made it, and nobody replaced them since); else undefined.
  at::Tensor flat_grad_of_shards() const {
    const at::Tensor& first = params.front().shard.grad();
    if (!first.defined()) return {};
    const c10::Storage& storage = first.storage();
    if (storage.nbytes() != static_cast<size_t>(shard_numel) * sizeof(float)) return {};
    for (const auto& p : params) {
      const at::Tensor& g = p.shard.grad();
      if (!g.defined() || !g.storage().is_alias_of(storage) || g.scalar_type() != at::kFloat || !g.is_contiguous() ||
          g.storage_offset() != p.offset)
        return {};
    }
    return at::empty({0}, first.options()).set_(storage, 0, {shard_numel}, {1});
  }

  // Adds the reduced shard to the shards' gradients, which are views of the flat gradient. After the
  // step's final backward the gradients are final (gradients_ready).
  void accumulate() {
    at::NoGradGuard no_grad;
    bool fresh = true;
    for (const auto& p : params) fresh = fresh && !p.shard.grad().defined();
    at::Tensor flat_grad = fresh ? at::Tensor() : flat_grad_of_shards();
    const bool ours = flat_grad.defined();
    if (fresh)  // like the shard: pinned host memory when offloaded from a GPU
      flat_grad = at::empty(flat_shard.sizes(), flat_shard.options().pinned_memory(flat_shard.is_pinned()));
    // Offloaded from a GPU: the reduced shard comes back to pinned host memory without blocking the
    // host inside backward; finish_backward synchronizes once before the optimizer reads it.
    const bool to_host = rs_out.is_cuda() && flat_grad.is_cpu() && flat_grad.is_pinned();
    if (fresh) {
      flat_grad.copy_(rs_out, /*non_blocking=*/to_host);
      fsdp->host_copies_pending_ = fsdp->host_copies_pending_ || to_host;
      for (auto& p : params)
        p.shard.mutable_grad() = flat_grad.slice(0, p.offset, p.offset + p.shard.numel()).view(p.shard.sizes());
    } else if (ours && to_host) {
      at::Tensor staged = at::empty(rs_out.sizes(), flat_grad.options().dtype(rs_out.scalar_type()).pinned_memory(true));
      staged.copy_(rs_out, /*non_blocking=*/true);
      fsdp->host_adds_.emplace_back(flat_grad, staged);  // added after the synchronization
      fsdp->host_copies_pending_ = true;
    } else if (ours) {
      flat_grad.add_(rs_out.to(flat_grad.device(), at::kFloat));
    } else {  // someone replaced the gradients: add per parameter
      for (auto& p : params) {
        at::Tensor part = rs_out.slice(0, p.offset, p.offset + p.shard.numel()).view(p.shard.sizes()).to(p.shard.device(), at::kFloat);
        if (p.shard.grad().defined())
          p.shard.mutable_grad().add_(part);
        else
          p.shard.mutable_grad() = part.clone();
      }
    }
    fsdp->release(rs_out);
    if (fsdp->gradients_ready_ && fsdp->final_backward_) {
      if (fsdp->host_copies_pending_)
        final_pending = true;  // ready once finish_backward has synchronized with the copies
      else
        gradients_final();
    }
  }

  void gradients_final() {
    final_pending = false;
    std::vector<at::Tensor> shards;
    for (const auto& p : params) shards.push_back(p.shard);
    fsdp->gradients_ready_(shards);
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

at::Tensor FSDP::acquire(int64_t numel, at::ScalarType dtype, const at::Device& device) {
  auto& free = free_[{dtype, device.str()}];
  auto best = free.end();
  for (auto it = free.begin(); it != free.end(); ++it)
    if (it->numel() >= numel && (best == free.end() || it->numel() < best->numel())) best = it;
  at::Tensor base;
  if (best != free.end()) {
    base = std::move(*best);
    free.erase(best);
  } else {
    ++pool_allocations_;
    base = at::empty({numel}, at::TensorOptions().dtype(dtype).device(device));
  }
  in_use_[base.storage().unsafeGetStorageImpl()] = base;
  return base.slice(0, 0, numel);
}

void FSDP::release(at::Tensor& buffer) {
  if (!buffer.defined()) return;
  auto it = in_use_.find(buffer.storage().unsafeGetStorageImpl());
  TITAN_ASSERT(it != in_use_.end(), "FSDP: released a buffer the pool did not hand out");
  free_[{it->second.scalar_type(), buffer.device().str()}].push_back(std::move(it->second));
  in_use_.erase(it);
  buffer.reset();
}

void FSDP::fully_shard(const std::vector<UnitPart>& parts, const InitRows& init, bool keep_after_forward) {
  TITAN_ASSERT(!parts.empty(), "fully_shard of no modules");
  std::set<const void*> owned = skipped_;
  for (const auto& u : units_)
    for (const auto& p : u->params) owned.insert(p.full.unsafeGetTensorImpl());
  auto unit = std::make_unique<Unit>();
  unit->fsdp = this;
  unit->prefix = parts.front().prefix;
  const bool is_root = parts.size() == 1 && parts.front().prefix.empty();
  unit->reshard_after_forward = options_.reshard_after_forward == "always" ||
                                (options_.reshard_after_forward == "default" && !is_root && !keep_after_forward);
  const int64_t n = shard_.size(), k = shard_.rank();

  // Float8 all-gather: the float8 linear layers of the parts, by weight.
  std::map<const void*, nn::LinearImpl*> float8_layers;
  if (options_.float8_all_gather)
    for (const auto& part : parts)
      for (const auto& item : part.module->named_modules("", /*include_self=*/true))
        if (auto* linear = dynamic_cast<nn::LinearImpl*>(item.value().get()); linear && linear->float8) {
          TITAN_ASSERT(linear->float8->name == "tensorwise", "the float8 all-gather needs the tensorwise recipe");
          float8_layers[linear->weight.unsafeGetTensorImpl()] = linear;
        }

  // The unit's parameters and their places in the flat shard and the full buffer.
  for (const auto& part : parts) {
    for (const auto& item : part.module->named_parameters()) {
      at::Tensor full = item.value();
      if (!owned.insert(full.unsafeGetTensorImpl()).second) continue;
      TITAN_ASSERT(full.scalar_type() == at::kFloat && full.dim() >= 1, "fully_shard needs fp32 parameters of 1+ dims: ",
                   part.prefix + item.key());
      Unit::Param p;
      p.name = part.prefix + item.key();
      p.shape = full.sizes().vec();
      p.rows = p.shape[0];
      p.row = row_elems(p.shape);
      p.shard_rows = (p.rows + n - 1) / n;  // torch.chunk's rows per rank; the last ranks may hold padding
      p.offset = unit->shard_numel;
      unit->shard_numel += p.shard_rows * p.row;
      if (const auto it = float8_layers.find(full.unsafeGetTensorImpl()); it != float8_layers.end()) {
        nn::LinearImpl& linear = *it->second;
        p.fp8 = std::make_shared<nn::Float8Weight>();
        p.fp8->data = holder(p.shape, full.options().dtype(at::kFloat8_e4m3fn));
        p.fp8->scale = at::ones({}, full.options().dtype(at::kFloat));
        linear.float8_weight = p.fp8;
        const nn::Float8Sharding* split = linear.float8_sharding.get();
        if (split && (split->dim == 'N' || split->dim == 'K')) p.tp_max = &split->max_over_ranks;
        p.full_offset = unit->full8_numel;
        unit->full8_numel += p.rows * p.row;
        ++unit->num_fp8;
      } else {
        p.full_offset = unit->full_numel;
        unit->full_numel += p.rows * p.row;
      }
      p.full = full;
      unit->device = full.device();
      unit->params.push_back(std::move(p));
    }
  }
  if (unit->num_fp8 > 0) {
    // The byte all-gather's layout: each parameter's piece aligned to its element size, a rank's piece
    // to 16 bytes (every view of it as param_dtype or float8 stays aligned).
    for (auto& p : unit->params) {
      const int64_t size = p.fp8 ? 1 : static_cast<int64_t>(c10::elementSize(options_.param_dtype));
      p.gather_offset = round_up(unit->gather_bytes, size);
      unit->gather_bytes = p.gather_offset + p.shard_rows * p.row * size;
    }
    unit->gather_bytes = round_up(unit->gather_bytes, 16);
  }
  if (unit->params.empty()) {
    // A root whose parameters all belong to inner units (a pipeline stage of blocks only): no unit
    // of its own; the inner units are linked in execution order.
    TITAN_ASSERT(is_root, "fully_shard of '", unit->prefix, "': no parameters left to shard");
    link_units(nullptr);
    return;
  }

  at::NoGradGuard no_grad;
  at::TensorOptions shard_opts = at::TensorOptions().dtype(at::kFloat).device(unit->device);
  if (options_.offload_to_cpu) shard_opts = shard_opts.device(at::kCPU).pinned_memory(unit->device.is_cuda());
  unit->flat_shard = at::zeros({unit->shard_numel}, shard_opts);
  for (auto& p : unit->params) {
    std::vector<int64_t> shard_shape = p.shape;
    shard_shape[0] = p.shard_rows;
    p.shard = at::empty({0}, unit->flat_shard.options()).set_(unit->flat_shard.storage(), p.offset, shard_shape);
    const int64_t begin = std::min(p.rows, k * p.shard_rows), end = std::min(p.rows, (k + 1) * p.shard_rows);
    if (end > begin) {
      at::Tensor mine = p.shard.slice(0, 0, end - begin);
      if (has_storage(p.full)) {
        mine.copy_(p.full.slice(0, begin, end));
      } else {  // built without memory: only this rank's rows are ever computed
        TITAN_ASSERT(init, "fully_shard of '", p.name, "': a parameter without values and no init function");
        init(p.name, mine, begin);
      }
    }
    p.shard.requires_grad_(true);
    // The module's parameter becomes the param_dtype holder of the full tensor, without storage (its
    // shape on an empty storage: the full size is never allocated here).
    at::Tensor holder = at::empty({0}, p.full.options().dtype(options_.param_dtype));
    holder.unsafeGetTensorImpl()->set_sizes_contiguous(p.shape);
    p.full.set_data(holder);
    torch::autograd::impl::set_post_acc_grad_hooks(p.full, std::make_unique<GradReadyHook>(unit.get()));
  }
  Unit* u = unit.get();
  parts.front().module->add_forward_pre_hook([u] { u->pre_forward(); });
  parts.back().module->add_forward_hook([u](const at::Tensor& out) { return u->post_forward(out); });
  units_.push_back(std::move(unit));
  if (is_root) link_units(u);
}

void FSDP::skip(const std::vector<at::Tensor>& params) {
  for (const auto& p : params) skipped_.insert(p.unsafeGetTensorImpl());
}

void FSDP::link() {
  if (!units_.empty()) link_units(nullptr);
}

void FSDP::link_units(Unit* root) {
  rooted_ = root != nullptr;
  // Execution order: the root's forward starts first, then the inner units in the order they were
  // sharded; backward runs them in reverse and the root (the embedding) last.
  const size_t inner = units_.size() - (root ? 1 : 0);
  for (size_t i = 0; i < inner; ++i) {
    units_[i]->next_forward = i + 1 < inner ? units_[i + 1].get() : nullptr;
    units_[i]->next_backward = i > 0 ? units_[i - 1].get() : root;
    units_[i]->backward_before = i + 1 < inner ? units_[i + 1].get() : nullptr;
  }
  if (!root) return;
  root->next_forward = inner > 0 ? units_[0].get() : nullptr;
  root->next_backward = inner > 0 ? units_[inner - 1].get() : nullptr;
}

void FSDP::precompute_float8_scales() {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> amaxes;
  const std::function<void(at::Tensor&)>* tp_max = nullptr;
  for (auto& u : units_) {
    if (u->num_fp8 == 0) continue;
    amaxes.push_back(u->local_amaxes());
    if (!tp_max) tp_max = u->tp_max();
  }
  if (amaxes.empty()) return;
  TraceRange range(mem::Phase::Communication, "FSDP::precompute_float8_scales");
  at::Tensor amax = at::cat(amaxes);
  Unit::max_over_ranks(amax, shard_, tp_max);
  const at::Tensor scales = e4m3_scales(amax);
  int64_t at = 0;
  for (auto& u : units_) {
    if (u->num_fp8 == 0) continue;
    u->precomputed_scales = scales.slice(0, at, at + u->num_fp8);
    at += u->num_fp8;
  }
}

int64_t FSDP::num_float8_gathered() const {
  int64_t n = 0;
  for (const auto& u : units_) n += u->num_fp8;
  return n;
}

std::vector<std::pair<std::string, at::Tensor>> FSDP::sharded_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& u : units_)
    for (const auto& p : u->params) out.emplace_back(p.name, p.shard);
  return out;
}

void FSDP::finish_backward() {
  if (!sync_gradients_) {  // no reductions: the full gradients accumulate; the parameters reshard
    for (auto& u : units_) {
      if (options_.reshard_after_backward) u->reshard();
      u->grads_ready = 0;
    }
    if (options_.return_buffers) free_.clear();
    return;
  }
  // Units that have not reduced in this backward (the root, and units whose parameters did not all
  // get a gradient) reduce now, in backward order (inner units last to first, then the root): every
  // rank issues every unit's reduce-scatter once per backward, in the same order. Then every
  // reduction is completed.
  const size_t inner = units_.size() - (rooted_ ? 1 : 0);
  for (size_t i = inner; i-- > 0;)
    if (!units_[i]->reduced) units_[i]->reduce_grads();
  if (rooted_ && !units_.back()->reduced) units_.back()->reduce_grads();
  for (auto& u : units_) {
    u->reduced = false;
    u->step_scales.reset();  // an optimizer step may come next
  }
  for (auto& u : units_) u->complete_reduce_scatter();
  for (auto& u : units_) u->complete_all_reduce();
  if (host_copies_pending_) {  // CPU offload from a GPU: the gradients' copies to the host complete
    torch::cuda::synchronize();
    at::NoGradGuard no_grad;
    for (auto& [grad, staged] : host_adds_) grad.add_(staged.to(at::kFloat));
    host_adds_.clear();
    host_copies_pending_ = false;
    for (auto& u : units_)
      if (u->final_pending) u->gradients_final();
  }
  // Nothing is in flight: the free buffers go back to the allocator (units kept gathered still hold
  // theirs).
  if (options_.return_buffers) free_.clear();
}

int64_t FSDP::pooled_bytes(at::ScalarType dtype) const {
  int64_t bytes = 0;
  for (const auto& [key, list] : free_)
    if (dtype == at::ScalarType::Undefined || key.first == dtype)
      for (const auto& b : list) bytes += b.numel() * b.element_size();
  return bytes;
}

std::vector<PlacedTensor> FSDP::placed_parameters() const {
  std::vector<PlacedTensor> out;
  for (const auto& u : units_) {
    for (const auto& p : u->params) {
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
