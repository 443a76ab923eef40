#include "titan/tools/dry_run.h"

#include "titan/common/autocast.h"
#include "titan/common/error.h"
#include "titan/common/grad_norm.h"
#include "titan/common/meta_device.h"
#include "titan/components/optimizer/optimizer.h"
#include "titan/distributed/context_parallel.h"
#include "titan/distributed/ddp.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/expert_parallel.h"
#include "titan/distributed/pipeline.h"
#include "titan/distributed/placement.h"
#include "titan/nn/loss.h"
#include "titan/models/registry.h"

#include <ATen/ATen.h>
#include <ATen/SDPBackend.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/stack.h>
#include <c10/core/Allocator.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <numeric>
#include <set>

namespace titan {
namespace {

// ---------------------------------------------------------------------------------------------
// The counting meta allocator.
//
// Meta tensors have storage without bytes. While a dry run is active, this allocator gives each
// allocation a distinct, aligned, non-null address and counts its size (current and peak), as the
// counting CPU allocator does for CPU tensors. The addresses start at 2^62, which no process maps
// (user space ends at 2^47 on x86-64, 2^52 on AArch64), so a stray dereference faults; FSDP needs
// real-looking addresses because it offsets and compares data pointers (parameters pointed into a
// gathered buffer, gradients recognized as views of its flat buffer). Outside a dry run it
// behaves like libtorch's own meta allocator (null data, nothing counted).

std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_current{0}, g_peak{0};
constexpr uintptr_t kFirstAddress = uintptr_t{1} << 62;
std::atomic<uintptr_t> g_next_address{kFirstAddress};

void release_counted(void* size) { g_current.fetch_sub(reinterpret_cast<int64_t>(size), std::memory_order_relaxed); }
void release_nothing(void*) {}

class CountingMetaAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    const c10::Device meta(c10::kMeta);
    if (!g_counting.load(std::memory_order_relaxed)) return {nullptr, nullptr, &release_nothing, meta};
    const uintptr_t stride = ((n + 511) & ~uintptr_t{511}) + 512;  // aligned, with a gap: no two touch
    void* data = reinterpret_cast<void*>(g_next_address.fetch_add(stride, std::memory_order_relaxed));
    const auto bytes = static_cast<int64_t>(n);
    const int64_t now = g_current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    int64_t peak = g_peak.load(std::memory_order_relaxed);
    while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
    // The context is the size (null for 0 bytes: nothing to release).
    return {data, reinterpret_cast<void*>(static_cast<uintptr_t>(n)), &release_counted, meta};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void*, const void*, std::size_t) const override {}  // meta tensors hold no data
};

}  // namespace

MetaCounting::MetaCounting() {
  static std::once_flag once;
  std::call_once(once, [] {
    static CountingMetaAllocator allocator;
    c10::SetAllocator(c10::kMeta, &allocator, /*priority=*/200);
  });
  TITAN_ASSERT(!g_counting.exchange(true), "one dry run at a time");
  g_current = 0;
  g_peak = 0;
  g_next_address = kFirstAddress;
}
MetaCounting::~MetaCounting() { g_counting = false; }
int64_t MetaCounting::current() const { return g_current.load(); }
int64_t MetaCounting::peak() const { return g_peak.load(); }
void MetaCounting::reset_peak() { g_peak = g_current.load(); }

namespace {

// ---------------------------------------------------------------------------------------------
// Meta kernels libtorch (2.11, C++) lacks for operators the models and the loss use; PyTorch has
// them only as Python meta registrations. Each allocates its results as the CPU kernel does.

at::Tensor index_select_meta(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  std::vector<int64_t> sizes = self.sizes().vec();
  if (!sizes.empty()) sizes[c10::maybe_wrap_dim(dim, self.dim())] = index.numel();
  return at::empty(sizes, self.options());
}

at::Tensor embedding_dense_backward_meta(const at::Tensor& grad, const at::Tensor& indices, int64_t num_weights,
                                         int64_t padding_idx, bool scale_grad_by_freq) {
  return at::zeros({num_weights, grad.size(-1)}, grad.options());
}

at::Tensor where_meta(const at::Tensor& condition, const at::Tensor& self, const at::Tensor& other) {
  const auto sizes = at::infer_size(at::infer_size(condition.sizes(), self.sizes()), other.sizes());
  return at::empty(sizes, self.options().dtype(at::result_type(self, other)));
}

at::Tensor dot_meta(const at::Tensor& self, const at::Tensor& other) { return at::empty({}, self.options()); }

// Unary out= kernels. Resizing a meta tensor only sets its byte count (it would go uncounted), so
// an output of the wrong size gets new storage from the allocator, as the CPU's resize allocates.
at::Tensor& unary_out_meta(const at::Tensor& self, at::Tensor& out) {
  if (out.sizes() != self.sizes()) out.set_(at::empty(self.sizes(), out.options()));
  return out;
}

// Element-wise logical operations of two tensors: the broadcast shape (tensor parallelism's masks).
at::Tensor& binary_out_meta(const at::Tensor& self, const at::Tensor& other, at::Tensor& out) {
  const auto shape = at::infer_size(self.sizes(), other.sizes());
  if (out.sizes() != c10::IntArrayRef(shape)) out.set_(at::empty(shape, out.options()));
  return out;
}

// The CPU flash attention: output (B, H, S, E) laid out as (B, S, H, E), log-sum-exp (B, H, S) in
// fp32; CUDA's flash and cuDNN kernels keep the same. Backward: gradients shaped like q, k, v.
std::tuple<at::Tensor, at::Tensor> flash_attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                       double dropout_p, bool is_causal,
                                                       const std::optional<at::Tensor>& attn_mask,
                                                       std::optional<double> scale) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), E = v.size(3);
  const at::ScalarType acc = at::isReducedFloatingType(q.scalar_type()) ? at::kFloat : q.scalar_type();
  return {at::empty({B, S, H, E}, q.options()).transpose(1, 2),
          at::empty({B, S, H}, q.options().dtype(acc)).transpose(1, 2)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& logsumexp, double dropout_p, bool is_causal, const std::optional<at::Tensor>& attn_mask,
    std::optional<double> scale) {
  return {at::empty_like(q), at::empty_like(k), at::empty_like(v)};
}

// Float8 matmuls (nn/float8.h): (M, N) in the output dtype.
at::Tensor scaled_mm_meta(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a, const at::Tensor& scale_b,
                          const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_result,
                          std::optional<at::ScalarType> out_dtype, bool use_fast_accum) {
  return at::empty({a.size(0), b.size(1)}, a.options().dtype(out_dtype.value_or(a.scalar_type())));
}

// .item() on a meta tensor: a placeholder value (the for-loop optimizer reads its step count).
at::Scalar local_scalar_dense_meta(const at::Tensor& self) {
  if (at::isFloatingType(self.scalar_type())) return at::Scalar(1.0);
  return at::Scalar(int64_t{1});
}

// In-place operators that allocate nothing (the fused optimizers): pop the arguments.
void in_place_no_op(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  torch::jit::drop(*stack, op.schema().arguments().size());
}

// scaled_dot_product_attention on meta tensors runs the fused kernel (flash), as the CPU and CUDA
// choose for the models' causal attention: the meta device's own choice is the math fallback, which
// would save S x S scores no real run keeps. The fused kernel reads grouped key/value heads in place.
int64_t fused_sdp_choice_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, double, bool, std::optional<double>, bool) {
  return static_cast<int64_t>(at::SDPBackend::flash_attention);
}

at::Tensor sdpa_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                     std::optional<double> scale, bool enable_gqa) {
  return std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, attn_mask, scale));
}

// ---- CUDA bf16 autocast, emulated on meta tensors (models trained without FSDP in mixed
// precision). Autocast has no meta dispatch key, so linear layers cast here as CUDA's autocast
// does: fp32 inputs and weights to the autocast dtype, the matmul in it. Autocast caches the cast of
// a weight for the rest of the forward pass; where no graph saves it (checkpointed forward passes)
// the cache is what keeps it alive, so those casts are held until the forward ends
// (clear_autocast_casts). An fp32 activation read by several layers is cast once while it is alive.
// (Norms, float8 layers and MoE experts take the autocast dtype themselves: compute_dtype,
// common/autocast.h, looks up CUDA's autocast for a meta tensor standing for a CUDA one.)
using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
struct AutocastCasts {
  std::vector<at::Tensor> weights_held;
  std::map<const void*, std::pair<WeakImpl, WeakImpl>> activations;  // source -> its cast
};
AutocastCasts g_casts;

at::Tensor autocast_cast(const at::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() != at::kFloat) return t;
  if (t.is_leaf() && t.requires_grad()) {
    at::Tensor cast = t.to(dtype);
    if (!at::GradMode::is_enabled()) g_casts.weights_held.push_back(cast);
    return cast;
  }
  auto it = g_casts.activations.find(t.unsafeGetTensorImpl());
  if (it != g_casts.activations.end()) {
    auto source = it->second.first.lock(), cast = it->second.second.lock();
    if (source && source.get() == t.unsafeGetTensorImpl() && cast) return at::Tensor(std::move(cast));
  }
  at::Tensor cast = t.to(dtype);
  g_casts.activations.insert_or_assign(t.unsafeGetTensorImpl(),
                                      std::make_pair(WeakImpl(t.getIntrusivePtr()), WeakImpl(cast.getIntrusivePtr())));
  return cast;
}

void clear_autocast_casts() {
  g_casts.weights_held.clear();
  g_casts.activations.clear();
}

at::Tensor linear_autocast_meta(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TITAN_ASSERT(!bias || !bias->defined(), "the dry run's linear takes no bias");
  if (!at::autocast::is_autocast_enabled(at::kCUDA)) return at::matmul(input, weight.t());  // at::linear's own path
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(at::kCUDA);
  return at::matmul(autocast_cast(input, dtype), autocast_cast(weight, dtype).t());
}

// The registrations above, for a dry run's lifetime.
class MetaKernels {
 public:
  explicit MetaKernels(bool emulate_autocast)
      : meta_(torch::Library::IMPL, "aten", c10::DispatchKey::Meta, __FILE__, __LINE__),
        autograd_(torch::Library::IMPL, "aten", c10::DispatchKey::AutogradMeta, __FILE__, __LINE__) {
    meta_.impl("index_select", TORCH_FN(index_select_meta));
    meta_.impl("embedding_dense_backward", TORCH_FN(embedding_dense_backward_meta));
    meta_.impl("where.self", TORCH_FN(where_meta));
    meta_.impl("dot", TORCH_FN(dot_meta));
    meta_.impl("abs.out", TORCH_FN(unary_out_meta));
    meta_.impl("logical_not.out", TORCH_FN(unary_out_meta));
    meta_.impl("logical_or.out", TORCH_FN(binary_out_meta));
    meta_.impl("logical_and.out", TORCH_FN(binary_out_meta));
    meta_.impl("_scaled_dot_product_flash_attention_for_cpu", TORCH_FN(flash_attention_meta));
    meta_.impl("_scaled_dot_product_flash_attention_for_cpu_backward", TORCH_FN(flash_attention_backward_meta));
    meta_.impl("_local_scalar_dense", TORCH_FN(local_scalar_dense_meta));
    meta_.impl("_scaled_mm", TORCH_FN(scaled_mm_meta));
    meta_.impl("_fused_adamw_", torch::CppFunction::makeFromBoxedFunction<&in_place_no_op>());
    meta_.impl("_fused_adam_", torch::CppFunction::makeFromBoxedFunction<&in_place_no_op>());
    autograd_.impl("_fused_sdp_choice", TORCH_FN(fused_sdp_choice_meta));
    autograd_.impl("scaled_dot_product_attention", TORCH_FN(sdpa_meta));
    if (emulate_autocast) autograd_.impl("linear", TORCH_FN(linear_autocast_meta));
  }
  ~MetaKernels() { clear_autocast_casts(); }

 private:
  torch::Library meta_, autograd_;
};

}  // namespace

DryRunDevice::DryRunDevice() : kernels_(std::make_shared<MetaKernels>(false)) {}
DryRunDevice::~DryRunDevice() = default;

namespace {

// ---------------------------------------------------------------------------------------------
// A collective backend whose operations complete at once and move nothing (meta tensors hold no
// data); dist::Group still counts every operation's bytes. Point-to-point messages (pipeline
// stages) and all-to-all shifts (ring attention's rotation) too: a receive leaves its buffer as
// allocated, which is all a meta tensor has.
struct DoneWork : c10d::Work {
  bool wait(std::chrono::milliseconds) override { return true; }
  bool isCompleted() override { return true; }
};

struct NoDataBackend : c10d::Backend {
  NoDataBackend(int rank, int size) : Backend(rank, size) {}
  const std::string getBackendName() const override { return "dry-run"; }
  static c10::intrusive_ptr<c10d::Work> done() { return c10::make_intrusive<DoneWork>(); }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor&, at::Tensor&, const c10d::AllgatherOptions&) override {
    return done();
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor&, at::Tensor&,
                                                      const c10d::ReduceScatterOptions&) override {
    return done();
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override {
    return done();
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>&, const c10d::BroadcastOptions&) override {
    return done();
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>&, int, int) override { return done(); }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>&, int, int) override { return done(); }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor&, at::Tensor&, std::vector<int64_t>&, std::vector<int64_t>&,
                                               const c10d::AllToAllOptions&) override {
    return done();
  }
};

// The groups this rank uses, as the trainer's mesh names them; this rank is member 0 of each but
// pp (member pp_rank) and cp (the last member: its queries attend to every rank's keys, so no
// block of the ring is skipped whatever the split).
class DryMesh {
 public:
  DryMesh(const DryRunPlan& p) {
    add("dp_shard_cp", p.dp_shard * p.cp);
    add("dp_replicate", p.dp_replicate);
    add("dp", p.dp_replicate * p.dp_shard);
    add("dp_cp", p.dp_replicate * p.dp_shard * p.cp);
    add("tp", p.tp);
    add("cp", p.cp, static_cast<int>(p.cp) - 1);
    add("pp", p.pp, p.pp_rank);
    add("ep", p.ep);
    add("efsdp", p.dp_shard * p.cp / p.ep);
  }
  dist::Group& operator[](const std::string& name) {
    auto it = groups_.find(name);
    TITAN_ASSERT(it != groups_.end(), "the dry run has no group '", name, "'");
    return *it->second;
  }
  dist::CommBytes bytes, calls;

 private:
  void add(const std::string& name, int64_t size, int rank = 0) {
    std::vector<int> ranks(static_cast<size_t>(size));
    std::iota(ranks.begin(), ranks.end(), 0);
    c10::intrusive_ptr<c10d::Backend> backend;
    if (size > 1) backend = c10::make_intrusive<NoDataBackend>(rank, static_cast<int>(size));
    groups_[name] = std::make_unique<dist::Group>(name, ranks, rank, backend, &bytes, &calls);
  }
  std::map<std::string, std::unique_ptr<dist::Group>> groups_;
};

int64_t nbytes(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// dist::grad_norm_and_clip_divisor over the dry run's groups: the sum of squares of the gradients
// sharded over the same groups is all-reduced over those groups (placement.cpp), the total (fp64)
// over the `sum_over` groups (pp: every stage's gradients); returns the divisor the optimizer
// applies (undefined when max_norm <= 0). consumed: the
// gradients are gone (early_step_in_backward): the norm comes from their norms (dist::grad_norm_of),
// with the same all-reduces.
at::Tensor clip_grad_norm(const std::vector<dist::PlacedTensor>& params, double max_norm, DryMesh& mesh,
                          const std::vector<std::string>& sum_over, bool consumed = false) {
  std::map<std::vector<std::string>, std::vector<at::Tensor>> by_groups;
  for (const auto& p : params) {
    const at::Tensor g = p.local.grad();
    if (!g.defined() && !consumed) continue;
    std::set<std::string> names;
    for (const auto& s : p.placement.shards) names.insert(s.mesh_dim);
    by_groups[{names.begin(), names.end()}].push_back(g);
  }
  at::Tensor sum_sq;
  for (auto& [names, gs] : by_groups) {
    at::Tensor s = consumed ? at::zeros({}, at::TensorOptions().device(at::kMeta).dtype(at::kDouble))
                            : grad_sum_of_squares(gs);
    for (const auto& name : names) mesh[name].all_reduce(s).wait();
    sum_sq = sum_sq.defined() ? sum_sq + s : s;
  }
  if (!sum_sq.defined()) sum_sq = at::zeros({}, at::TensorOptions().device(at::kMeta).dtype(at::kDouble));
  if (!sum_over.empty()) sum_sq = sum_sq.to(at::kDouble).contiguous();
  for (const auto& name : sum_over) mesh[name].all_reduce(sum_sq).wait();
  return clip_divisor(sum_sq.sqrt(), max_norm);
}

DryRunResult run(const DryRunPlan& plan) {
  const bool autocast = !plan.fsdp && plan.param_dtype == at::kFloat && plan.mixed_dtype != at::kFloat;
  const bool pipelined = plan.pp > 1;
  MetaCounting memory;
  MetaStandsForCpu standing(!plan.cuda);
  MetaKernels kernels(autocast);
  DryMesh mesh(plan);
  const auto meta = at::TensorOptions().device(at::kMeta);
  DryRunResult r;

  // ---- the model (or this rank's pipeline stages), parallelized by its own function; DDP; the
  // optimizer (as Trainer::Trainer and Trainer::set_up_pipeline)
  const ModelSpec& spec = model_spec(plan.model);
  dist::DataParallelOptions dpo;
  dpo.fsdp.param_dtype = plan.mixed_dtype;
  dpo.fsdp.reduce_dtype = at::kFloat;
  dpo.fsdp.reshard_after_forward = plan.reshard_after_forward;
  if (pipelined) {
    // As the trainer: units stay gathered across the step's microbatches unless "always".
    dpo.fsdp.reshard_after_backward = plan.reshard_after_forward == "always";
    if (plan.reshard_after_forward == "default") dpo.fsdp.reshard_after_forward = "never";
  }
  dpo.shard_always = plan.fsdp;
  dpo.ddp_bucket_bytes = plan.ddp_bucket_bytes;
  dpo.fsdp.float8_all_gather = plan.float8.recipe && plan.float8_options.enable_fsdp_float8_all_gather;
  auto make_data_parallel = [&] {
    return std::make_unique<dist::DataParallel>(mesh["dp_shard_cp"], mesh["dp_replicate"], dpo,
                                                [](const std::string&, at::Tensor, const std::vector<int64_t>&) {},  // meta: no values
                                                at::Device(at::kMeta), plan.ep > 1 ? &mesh["efsdp"] : nullptr);
  };
  std::unique_ptr<dist::TensorParallel> tp;
  if (plan.tp > 1) tp = std::make_unique<dist::TensorParallel>(mesh["tp"], plan.tp_options);
  std::unique_ptr<dist::ContextParallel> cp;
  if (plan.cp > 1) cp = std::make_unique<dist::ContextParallel>(mesh["cp"], plan.cp_options);
  std::unique_ptr<dist::ExpertParallel> ep;
  if (plan.ep > 1) ep = std::make_unique<dist::ExpertParallel>(mesh["ep"]);
  TITAN_ASSERT(spec.parallelize, "model ", spec.name, " has no parallelize function");
  ParallelizeContext pctx;
  pctx.tensor_parallel = tp.get();
  pctx.context_parallel = cp.get();
  pctx.expert_parallel = ep.get();
  pctx.ac_mode = plan.ac_mode;
  pctx.ac_every = plan.ac_every;
  pctx.ac_block_modes = plan.ac_block_modes;
  pctx.ac_force_recompute = plan.ac_force_recompute;
  const int64_t B = plan.local_batch_size, S = plan.seq_len, S_local = S / plan.cp;  // the rank's part of each sequence
  std::vector<std::unique_ptr<dist::DataParallel>> dps;
  std::vector<LanguageModel> models;  // the whole model, or this rank's stages
  ParallelizedModel parallelized;     // the loss (the last stage's under pipeline parallelism)
  std::unique_ptr<dist::PipelineRunner> runner;
  if (!pipelined) {
    models.push_back(spec.build(plan.flavor, meta.dtype(plan.param_dtype), plan.seq_len));
    Float8Conversion f8 = plan.float8;
    convert_to_float8(*models.back(), f8, plan.float8_options);
    dps.push_back(make_data_parallel());
    pctx.data_parallel = dps.back().get();
    parallelized = spec.parallelize(*models.back(), pctx);
  } else {
    const PipelinePlan& pl = plan.pipeline;
    const int num_stages = static_cast<int>(pl.stage_modules.size());
    std::vector<dist::PipelineStage> stages;
    for (int s = 0; s < num_stages; ++s) {
      if (pl.stage_ranks.at(s) != plan.pp_rank) continue;
      r.stages.push_back(s);
      models.push_back(spec.build_stage(plan.flavor, meta.dtype(plan.param_dtype), plan.seq_len, pl.stage_modules[s]));
      Float8Conversion f8 = plan.float8;
      convert_to_float8(*models.back(), f8, plan.float8_options, /*record=*/false, /*require_some=*/false);
      dps.push_back(make_data_parallel());
      dist::DataParallel* dp = dps.back().get();
      pctx.data_parallel = dp;
      ParallelizedModel pm = spec.parallelize(*models.back(), pctx);
      if (s == num_stages - 1) parallelized = pm;
      dp->set_gradient_sync(false);  // reduced once per step, after the schedule
      dist::PipelineStage ps;
      ps.index = s;
      LanguageModelImpl* m = models.back().get();
      ps.forward = [m, autocast, S_local](const at::Tensor& in) {
        at::Tensor out;
        {
          CudaBf16Autocast scope(autocast);
          out = m->forward(in, S_local);
        }
        clear_autocast_casts();
        return out;
      };
      ps.parameters = models.back()->parameters();
      ps.after_backward = [dp] { dp->after_backward(false); };
      stages.push_back(std::move(ps));
    }
    // Hidden states cross between stages in the compute dtype (FSDP's param_dtype), as the trainer sends them.
    const at::ScalarType boundary_dtype = plan.fsdp ? plan.mixed_dtype : plan.param_dtype;
    runner = std::make_unique<dist::PipelineRunner>(mesh["pp"], pl.order, num_stages, pl.microbatches, std::move(stages),
                                                    meta.dtype(boundary_dtype));
  }
  std::vector<dist::PlacedTensor> params;
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& dp : dps) {
    params.insert(params.end(), dp->parameters().begin(), dp->parameters().end());
    for (auto& p : dp->named_parameters()) named.push_back(std::move(p));
  }
  const bool fsdp = dps.front()->fsdp() != nullptr, ddp = dps.front()->ddp() != nullptr;
  OptimizerOptions oo;
  oo.name = plan.optimizer;
  oo.implementation = plan.optimizer_implementation;
  Optimizer optimizer(named, oo);

  // MoE layers (Trainer::set_up_moe_aux_loss, update_expert_biases): with the auxiliary loss every
  // forward sums its routing counts over the ranks of the micro-batch; every step sums the layers'
  // counts (and auxiliary-loss terms) once.
  dist::Group* sequence_parallel_tp = tp && plan.tp_options.sequence_parallel ? &mesh["tp"] : nullptr;
  std::vector<nn::MoEImpl*> moe_layers;
  for (const LanguageModel& m : models)
    for (const auto& [prefix, layer] : m->moe_layers()) moe_layers.push_back(layer);
  for (nn::MoEImpl* layer : moe_layers) layer->force_load_balance = plan.moe_force_load_balance;
  const bool moe_aux_loss = plan.moe_aux_loss_coeff > 0;
  for (nn::MoEImpl* layer : moe_layers) {
    if (!moe_aux_loss) break;
    layer->aux_loss_weight = plan.moe_aux_loss_coeff;  // (any positive weight: the meta device computes no values)
    layer->global_counts = dist::routing_counts_sum(mesh["dp_cp"], sequence_parallel_tp);
  }

  // What this rank holds, from the tensors themselves.
  std::map<const void*, size_t> unit_of_storage;
  for (const auto& [name, t] : named) {
    r.params += nbytes(t);
    r.optimizer += 2 * nbytes(t) + 4;  // exp_avg, exp_avg_sq like the parameter; step: an fp32 scalar
    r.grads += t.numel() * (fsdp ? 4 : static_cast<int64_t>(t.element_size()));  // FSDP: fp32 flat gradient
    if (!fsdp) continue;
    auto [it, fresh] = unit_of_storage.emplace(t.storage().unsafeGetStorageImpl(), r.unit_shard_numel.size());
    if (fresh) r.unit_shard_numel.push_back(0);
    r.unit_shard_numel[it->second] += t.numel();
  }
  // Every bucket's flat copy is alive until finish_backward (not so with early_step_in_backward,
  // which updates and frees a bucket's parameters' gradients when the next bucket reduces).
  if (ddp && !plan.early_step) r.ddp_buckets = r.grads;
  if (plan.early_step) {  // Trainer::set_up_early_step
    TITAN_ASSERT(!pipelined, "early_step_in_backward under pipeline parallelism");
    optimizer.create_state();
    dps.front()->step_in_backward([&](const std::vector<at::Tensor>& ps) { optimizer.step_parameters(ps); });
  }
  const int64_t held = memory.current();

  // ---- three steps of Trainer::train_step; the peak is the largest of the second and third (the
  // first allocates what later steps reuse; under pipeline parallelism FSDP's buffer pool of the
  // last stage settles only in the third), the rest is the third's
  const double local_tokens = static_cast<double>(plan.grad_accum_steps * B * S);
  const double global_tokens = local_tokens * static_cast<double>(plan.dp_replicate * plan.dp_shard);
  constexpr int kSteps = 3, kLast = kSteps - 1;
  for (int step = 0; step < kSteps; ++step) {
    mesh.bytes.clear();
    mesh.calls.clear();
    memory.reset_peak();
    optimizer.zero_grad();
    at::Tensor loss_sum = at::zeros({}, meta.dtype(at::kFloat));
    for (int64_t micro = 0; micro < plan.grad_accum_steps; ++micro) {
      // The rank's part of each sequence (all of it without context parallelism).
      at::Tensor inputs_BS = at::empty({B, S_local}, meta.dtype(at::kLong));
      at::Tensor labels_BS = at::empty({B, S_local}, meta.dtype(at::kLong));
      if (pipelined) {
        // Trainer::pipeline_forward_backward: the schedule's actions over local_batch / mbs microbatches.
        const int64_t mbs = plan.pipeline.microbatch_size;
        const int64_t seq_local = tp && plan.tp_options.sequence_parallel ? S_local / plan.tp : S_local;
        const std::vector<int64_t> boundary = {mbs, seq_local, models.front()->hidden_size()};
        bool backward_seen = false;
        runner->before_action = [&](const dist::PipeAction& a) {
          if (a.op == dist::PipeOp::Forward || backward_seen) return;
          backward_seen = true;
          if (step == kLast && micro == 0) r.end_of_forward = memory.current();
        };
        at::Tensor losses = runner->train_step(
            boundary, [&](int m) { return inputs_BS.narrow(0, m * mbs, mbs); },
            [&](int m, const at::Tensor& logits_BSV) {
              return parallelized.loss_sum(logits_BSV.flatten(0, 1), labels_BS.narrow(0, m * mbs, mbs).flatten(0, 1)) /
                     global_tokens;
            });
        loss_sum += losses.to(at::kFloat);
        continue;
      }
      at::Tensor loss;
      {
        CudaBf16Autocast scope(autocast);
        at::Tensor logits_BSV = models.front()->forward(inputs_BS);
        loss = parallelized.loss_sum(logits_BSV.flatten(0, 1), labels_BS.flatten(0, 1)) / global_tokens;
      }
      clear_autocast_casts();  // autocast's cache ends with its scope
      if (step == kLast && micro == 0) r.end_of_forward = memory.current();
      const bool last = micro == plan.grad_accum_steps - 1;
      dps.front()->before_backward(last);
      loss.backward();
      dps.front()->after_backward(last);
      loss_sum += loss.detach();
    }
    if (pipelined) {
      for (auto& dp : dps) dp->reduce_gradients();
      mesh["pp"].all_reduce(loss_sum).wait();  // the last stage's loss, to every stage
    }
    if (cp) mesh["cp"].all_reduce(loss_sum).wait();  // each cp rank's loss covers its part of the sequences
    if (plan.early_step) {  // updated in backward; the norm from the gradients' norms (scalars)
      clip_grad_norm(params, 0, mesh, {}, /*consumed=*/true);
      optimizer.end_step();
    } else {
      optimizer.step(std::nullopt, clip_grad_norm(params, plan.max_norm, mesh,
                                                  pipelined ? std::vector<std::string>{"pp"} : std::vector<std::string>{}));
    }
    if (plan.float8_options.precompute_float8_dynamic_scale_for_fsdp)  // as the trainer
      for (auto& dp : dps)
        if (dp->fsdp()) dp->fsdp()->precompute_float8_scales();
    if (!moe_layers.empty()) {
      const int64_t L = static_cast<int64_t>(moe_layers.size()), E = moe_layers.front()->options().num_experts;
      at::Tensor figures = at::empty({L, E + (moe_aux_loss ? 1 : 0)}, meta.dtype(at::kFloat));
      dist::sum_routing_figures(figures, mesh["dp_cp"], sequence_parallel_tp);
    }
    at::Tensor local_avg = loss_sum * (global_tokens / local_tokens);
    mesh["dp"].all_reduce(loss_sum).wait();
    mesh["dp"].all_reduce(local_avg, c10d::ReduceOp::MAX).wait();
    if (step == 0)
      r.first_step_peak = memory.peak();
    else
      r.peak = std::max(r.peak, memory.peak());
  }
  // Alive after a step beyond the parameters: the optimizer state (created at the first step), the
  // gradients, and what is kept across steps (FSDP's buffer pool; model caches such as the RoPE table).
  r.buffers = std::max<int64_t>(0, memory.current() - held - (plan.early_step ? 0 : r.optimizer + r.grads));
  r.bytes = mesh.bytes;
  r.calls = mesh.calls;
  return r;
}

}  // namespace

DryRunResult dry_run(const DryRunPlan& plan) {
  try {
    return run(plan);
  } catch (const c10::NotImplementedError& e) {
    // A model uses an operator this file has no meta kernel for: say so, not just what libtorch says.
    throw std::runtime_error(std::string("the dry run on the meta device met an operator without a meta kernel; add "
                                         "one to MetaKernels in src/titan/tools/dry_run.cpp. LibTorch: ") +
                             e.what_without_backtrace());
  }
}

}  // namespace titan
