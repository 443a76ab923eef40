#include "titan/nn/float8.h"

#include "titan/common/autocast.h"
#include "titan/common/error.h"
#include "titan/common/meta_device.h"
#include "titan/nn/fused_kernels.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>

namespace titan::nn {

Float8Recipe Float8Recipe::named(const std::string& name, bool emulate) {
  Float8Recipe r;
  r.emulate = emulate;
  const Float8Cast e4m3_tensorwise{Float8Type::E4M3, Float8Scaling::Tensorwise};
  const Float8Cast e4m3_axiswise{Float8Type::E4M3, Float8Scaling::Axiswise};
  const Float8Cast high{Float8Type::HighPrecision, Float8Scaling::Tensorwise};
  if (name.empty() || name == "tensorwise") {
    r.name = "tensorwise";
    r.input = r.weight = r.weight_for_grad_input = r.input_for_grad_weight = e4m3_tensorwise;
    r.grad_output = r.grad_output_for_grad_weight = {Float8Type::E5M2, Float8Scaling::Tensorwise};
  } else if (name == "rowwise") {
    r.name = name;
    r.input = r.weight = r.grad_output = e4m3_axiswise;
    r.weight_for_grad_input = r.grad_output_for_grad_weight = r.input_for_grad_weight = e4m3_axiswise;
    r.round_scales_to_power_of_2 = true;
  } else if (name == "rowwise_with_gw_hp") {
    r.name = name;
    r.input = r.weight = r.grad_output = e4m3_axiswise;
    r.weight_for_grad_input = e4m3_tensorwise;
    r.grad_output_for_grad_weight = r.input_for_grad_weight = high;
    r.round_scales_to_power_of_2 = true;
  } else {
    throw UserError("quantize.linear.float8.recipe_name \"" + name +
                    "\" is not a float8 recipe: choose tensorwise (the default), rowwise or rowwise_with_gw_hp");
  }
  return r;
}

namespace {

at::ScalarType scalar_type(Float8Type t) { return t == Float8Type::E4M3 ? at::kFloat8_e4m3fn : at::kFloat8_e5m2; }
double max_of(Float8Type t) { return t == Float8Type::E4M3 ? 448.0 : 57344.0; }

// Whether products with `t` go to cuBLAS (CUDA, or the meta device standing for it in titan
// estimate's dry run), whose float8 kernels take A row-major and B column-major.
bool cublas_layouts(const at::Tensor& t) { return cuda_or_standing_for_it(t); }

}  // namespace

at::Tensor float8_scale(const at::Tensor& amax, Float8Type type, bool round_scales_to_power_of_2) {
  // In fp64 (torchao's order), stored in fp32.
  at::Tensor scale = (max_of(type) / amax.to(at::kDouble).clamp_min(1e-12)).to(at::kFloat);
  return round_scales_to_power_of_2 ? at::exp2(at::floor(at::log2(scale))) : scale;
}

at::Tensor float8_data(const at::Tensor& t, const at::Tensor& scale, Float8Type type, bool column_major) {
  // On CUDA titan's kernel: one pass, the layout written directly (no fp32 temporaries, no transposing copy).
  if (fused::float8_cast_accepts(t, scale)) return fused::float8_cast(t, scale, scalar_type(type), column_major);
  // The meta device standing for CUDA (titan estimate's dry run): the kernel's one allocation.
  if (t.is_meta() && meta_is_cuda()) {
    const at::TensorOptions fp8 = t.options().dtype(scalar_type(type));
    return column_major && t.dim() == 2 ? at::empty({t.size(1), t.size(0)}, fp8).t() : at::empty(t.sizes(), fp8);
  }
  const double fp8_max = max_of(type);
  const at::Tensor data = (t.to(at::kFloat) * scale).clamp(-fp8_max, fp8_max).to(scalar_type(type));
  return column_major && data.dim() == 2 ? data.t().contiguous().t() : data.contiguous();
}

Float8Operand float8_cast(const at::Tensor& t, const Float8Cast& cast, int64_t k_dim, bool round_scales_to_power_of_2,
                          const std::function<void(at::Tensor&)>* max_over_ranks, bool column_major) {
  TITAN_ASSERT(cast.type != Float8Type::HighPrecision, "float8_cast: a high-precision operand is not cast");
  TITAN_ASSERT(t.dim() == 2, "float8_cast: a matmul operand is 2-D");
  at::NoGradGuard no_grad;
  // max |t| in one reduction (the infinity norm), without |t| as a temporary.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  at::Tensor amax = cast.scaling == Float8Scaling::Tensorwise
                        ? at::linalg_vector_norm(t, kInf)
                        : at::linalg_vector_norm(t, kInf, at::IntArrayRef{k_dim}, /*keepdim=*/true);
  if (max_over_ranks) {
    amax = amax.to(at::kFloat).contiguous();  // (exact: an amax is one of the tensor's values)
    (*max_over_ranks)(amax);
  }
  const at::Tensor scale = float8_scale(amax, cast.type, round_scales_to_power_of_2);
  return {float8_data(t, scale, cast.type, column_major), scale};
}

at::Tensor float8_mm(const at::Tensor& a, const at::Tensor& b, const Float8Cast& ca, const Float8Cast& cb,
                     at::ScalarType out_dtype, const Float8Recipe& recipe, const std::function<void(at::Tensor&)>* max_a,
                     const std::function<void(at::Tensor&)>* max_b, bool fast_accum, const Float8Operand* b_cast,
                     const Float8Operand* a_cast) {
  const bool high_a = ca.type == Float8Type::HighPrecision, high_b = cb.type == Float8Type::HighPrecision;
  TITAN_ASSERT(high_a == high_b, "float8_mm: both operands are float8 or both high precision");
  // The products below run in the dtypes chosen here, not autocast's (an emulated product in fp32).
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  if (high_a) {
    const at::ScalarType dtype = a.scalar_type();
    return at::mm(a, b.to(dtype)).to(out_dtype);
  }
  // cuBLAS's float8 product takes A row-major and B column-major: the casts write those layouts.
  const bool cublas = cublas_layouts(a);
  const Float8Operand fa = a_cast ? *a_cast : float8_cast(a, ca, 1, recipe.round_scales_to_power_of_2, max_a, false);
  const Float8Operand fb = b_cast ? *b_cast : float8_cast(b, cb, 0, recipe.round_scales_to_power_of_2, max_b, cublas);
  at::NoGradGuard no_grad;
  const at::Tensor inv_a = fa.scale.reciprocal(), inv_b = fb.scale.reciprocal();
  if (recipe.emulate) {
    // The float8 values, multiplied in fp32.
    return at::mm(fa.data.to(at::kFloat) * inv_a, fb.data.to(at::kFloat) * inv_b).to(out_dtype);
  }
  const bool tensorwise = inv_a.numel() == 1 && inv_b.numel() == 1;
  if (cublas) {  // (meta: titan estimate's dry run of a CUDA run)
    // cuBLAS: A row-major, B column-major (an operand cast beforehand is copied into its layout when
    // it is in the other); rowwise scales (M, 1) and (1, N) (a tensorwise one expanded).
    const at::Tensor b_col = fb.data.t().contiguous().t();
    if (tensorwise)
      return at::_scaled_mm(fa.data.contiguous(), b_col, inv_a, inv_b, std::nullopt, std::nullopt, out_dtype,
                            fast_accum);
    const int64_t M = a.size(0), N = fb.data.size(1);
    const at::Tensor sa = inv_a.numel() == 1 ? inv_a.reshape({1, 1}).expand({M, 1}).contiguous() : inv_a;
    const at::Tensor sb = inv_b.numel() == 1 ? inv_b.reshape({1, 1}).expand({1, N}).contiguous() : inv_b;
    // Rowwise scaling writes bf16 (other output dtypes only on some GPUs and cuBLAS versions): the
    // product in bf16, then cast, as torchao computes it.
    return at::_scaled_mm(fa.data.contiguous(), b_col, sa, sb, std::nullopt, std::nullopt, at::kBFloat16, fast_accum)
        .to(out_dtype);
  }
  // CPU: the float8 values multiplied in fp32, as ATen's own CPU _scaled_mm computes them where it
  // emulates (each operand times its tensorwise scale, one fp32 matmul). ATen's oneDNN path, which it
  // takes instead on CPUs with AVX512-FP16, runs oneDNN's reference float8 kernel there: thousands of
  // times slower. An axiswise product is the product of the float8 values, scaled afterwards (each
  // scale is constant along K, so the value is the same).
  if (tensorwise) return at::mm(fa.data.to(at::kFloat) * inv_a, fb.data.to(at::kFloat) * inv_b).to(out_dtype);
  const at::Tensor product = at::mm(fa.data.to(at::kFloat), fb.data.to(at::kFloat));
  return (product * inv_a * inv_b).to(out_dtype);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using MaxFn = std::function<void(at::Tensor&)>;

// The all-reduce an operand's amax needs under `s` (null: none): the operand holds logical dims
// `dims` (two of M, N, K), the matmul sums over `k`.
const MaxFn* max_for(const Float8Sharding* s, const char* dims, char k, const Float8Cast& cast) {
  if (!s || s->dim == 0 || (dims[0] != s->dim && dims[1] != s->dim)) return nullptr;
  return cast.scaling == Float8Scaling::Tensorwise || s->dim == k ? &s->max_over_ranks : nullptr;
}

// A weight cast beforehand, checked to be in place (its owner keeps it while the layer runs).
Float8Operand checked(const Float8Weight& w) {
  TITAN_ASSERT(w.data.defined() && w.data.storage().nbytes() >= static_cast<size_t>(w.data.numel()),
               "a float8 layer ran while its float8 weight was not gathered");
  return {w.data, w.scale};
}

// The forward's B operand (K, N) from a weight (N, K) cast beforehand; none without one.
Float8Operand transposed(const Float8Weight* w) {
  if (!w) return {};
  const Float8Operand c = checked(*w);
  return {c.data.t(), c.scale};
}

// Whether `b` casts an operand exactly as `a` does with one scale over the whole tensor (tensorwise
// scaling and one float8 type for both, as the tensorwise recipe has it): then a's scale serves b.
bool same_tensorwise_cast(const Float8Cast& a, const Float8Cast& b) {
  return a.type != Float8Type::HighPrecision && a.scaling == Float8Scaling::Tensorwise && b.type == a.type &&
         b.scaling == Float8Scaling::Tensorwise;
}
// grad_input casts the weight as the output's product does / grad_weight casts the input so.
bool reuses_weight_scale(const Float8Recipe& r) { return same_tensorwise_cast(r.weight, r.weight_for_grad_input); }
bool reuses_input_scale(const Float8Recipe& r) { return same_tensorwise_cast(r.input, r.input_for_grad_weight); }

}  // namespace

// The casts of the inputs shared within a Float8SharedInputs scope: each input tensor (its identity
// and version) with how it was cast and the cast.
struct Float8SharedInputs::State {
  struct Entry {
    at::Tensor key;  // held: its address cannot be another tensor's while the scope lasts
    int64_t version;
    Float8Cast cast;
    bool round_scales_to_power_of_2;
    const MaxFn* max_over_ranks;
    Float8Operand operand;
  };
  std::vector<Entry> entries;
};

namespace {

thread_local Float8SharedInputs* shared_inputs = nullptr;

// The forward's cast of the input x (its 2-D view x2): the one made for the same tensor alike in
// the enclosing Float8SharedInputs scope, or a new one (recorded there).
Float8Operand input_cast(const at::Tensor& x, const at::Tensor& x2, const Float8Cast& cast, bool round,
                         const MaxFn* max_over_ranks) {
  Float8SharedInputs* scope = shared_inputs;
  if (const Float8SharedInputs::State* state = scope ? scope->existing() : nullptr) {
    for (const auto& e : state->entries)
      if (e.key.unsafeGetTensorImpl() == x.unsafeGetTensorImpl() && e.version == x._version() &&
          e.cast.type == cast.type && e.cast.scaling == cast.scaling && e.round_scales_to_power_of_2 == round &&
          e.max_over_ranks == max_over_ranks)
        return e.operand;
  }
  Float8Operand op = float8_cast(x2, cast, 1, round, max_over_ranks, false);
  if (scope) {
    // Casts of this tensor before it changed in place are never used again: not kept.
    auto& v = scope->state().entries;
    v.erase(std::remove_if(v.begin(), v.end(),
                           [&](const auto& e) {
                             return e.key.unsafeGetTensorImpl() == x.unsafeGetTensorImpl() && e.version != x._version();
                           }),
            v.end());
    v.push_back({x, x._version(), cast, round, max_over_ranks, op});
  }
  return op;
}

struct Float8LinearFn : public torch::autograd::Function<Float8LinearFn> {
  // `kept`: not a tensor input of the graph (the autograd function records every tensor input).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, int64_t recipe,
                            const std::optional<at::Tensor>& kept, int64_t sharding, int64_t cast_weight) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["recipe"] = recipe;
    ctx->saved_data["sharding"] = sharding;
    ctx->saved_data["cast_weight"] = cast_weight;
    if (kept && kept->defined()) return kept->detach();
    const Float8Recipe& r = *reinterpret_cast<const Float8Recipe*>(recipe);
    const auto* s = reinterpret_cast<const Float8Sharding*>(sharding);
    Float8Operand w_t = transposed(reinterpret_cast<const Float8Weight*>(cast_weight));
    const int64_t K = x.size(-1);
    const at::Tensor x2 = x.reshape({-1, K});
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // as float8_mm casts
    // The input cast here (or shared with the scope's other layers that take it); the tensorwise
    // recipe keeps its scale for grad_weight's cast of the same input (no second amax over x, nor its
    // all-reduce under tensor parallelism).
    std::optional<Float8Operand> x_cast;
    if (r.input.type != Float8Type::HighPrecision) {
      x_cast = input_cast(x, x2, r.input, r.round_scales_to_power_of_2, max_for(s, "MK", 'K', r.input));
      if (reuses_input_scale(r)) ctx->saved_data["input_scale"] = x_cast->scale;
    }
    if (!w_t.data.defined() && reuses_weight_scale(r)) {
      // The weight cast here (cuBLAS's layout on CUDA), its scale kept for grad_input's cast. (Under
      // per-operator checkpointing the kept output returns above: the backward casts afresh.)
      w_t = float8_cast(w.t(), r.weight, 0, r.round_scales_to_power_of_2, max_for(s, "NK", 'K', r.weight),
                        cublas_layouts(x));
      ctx->saved_data["weight_scale"] = w_t.scale;
    }
    // (A weight cast beforehand may have no memory of its own: not even a view of it is taken.)
    const at::Tensor y = float8_mm(x2, w_t.data.defined() ? at::Tensor() : w.t(), r.input, r.weight, x.scalar_type(), r,
                                   max_for(s, "MK", 'K', r.input), max_for(s, "NK", 'K', r.weight), /*fast_accum=*/true,
                                   w_t.data.defined() ? &w_t : nullptr, x_cast ? &*x_cast : nullptr);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = w.size(0);
    return y.view(shape);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const Float8Recipe& r = *reinterpret_cast<const Float8Recipe*>(ctx->saved_data["recipe"].toInt());
    const auto* s = reinterpret_cast<const Float8Sharding*>(ctx->saved_data["sharding"].toInt());
    const auto* cast_weight = reinterpret_cast<const Float8Weight*>(ctx->saved_data["cast_weight"].toInt());
    const int64_t K = x.size(-1), N = w.size(0);
    const at::Tensor g = grads[0].reshape({-1, N});
    const bool want_x = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    // The tensorwise recipe casts the output gradient alike for both products (one scale over the
    // whole tensor, taken over the same ranks): cast once, used transposed for grad_weight.
    const auto tensorwise = [](const Float8Cast& c) {
      return c.type != Float8Type::HighPrecision && c.scaling == Float8Scaling::Tensorwise;
    };
    std::optional<Float8Operand> g_cast, g_t_cast;
    if (want_x && want_w && tensorwise(r.grad_output) && tensorwise(r.grad_output_for_grad_weight) &&
        r.grad_output.type == r.grad_output_for_grad_weight.type) {
      g_cast = float8_cast(g, r.grad_output, 1, r.round_scales_to_power_of_2, max_for(s, "MN", 'N', r.grad_output));
      // For cuBLAS grad_weight's A is gyᵀ row-major: gy cast again under the same scale straight into
      // that layout (cheaper than transposing the float8 copy); elsewhere the same values transposed.
      g_t_cast = Float8Operand{cublas_layouts(g) ? float8_data(g.t(), g_cast->scale, r.grad_output.type) : g_cast->data.t(),
                               g_cast->scale};
    }
    at::Tensor gx, gw;
    if (want_x) {
      // The tensorwise recipe casts the weight for grad_input as for the output: a weight cast
      // beforehand serves both, and otherwise the forward's scale does (the same weight: no second
      // amax over it, nor its all-reduce under tensor parallelism), where the forward cast it.
      Float8Operand cast = cast_weight ? checked(*cast_weight) : Float8Operand{};
      if (!cast_weight && ctx->saved_data.count("weight_scale")) {
        const at::Tensor scale = ctx->saved_data["weight_scale"].toTensor();
        cast = {float8_data(w, scale, r.weight_for_grad_input.type, cublas_layouts(g)), scale};
      }
      gx = float8_mm(g, cast.data.defined() ? at::Tensor() : w, r.grad_output, r.weight_for_grad_input, x.scalar_type(), r,
                     max_for(s, "MN", 'N', r.grad_output), max_for(s, "NK", 'N', r.weight_for_grad_input), false,
                     cast.data.defined() ? &cast : nullptr, g_cast ? &*g_cast : nullptr)
               .view(x.sizes());
    }
    if (want_w) {
      // The tensorwise recipe's input cast again under the forward's scale, in the layout cuBLAS
      // takes for B (where the forward cast it; under per-operator checkpointing it did not).
      const at::Tensor x2 = x.reshape({-1, K});
      std::optional<Float8Operand> x_cast;
      if (ctx->saved_data.count("input_scale")) {
        const at::Tensor scale = ctx->saved_data["input_scale"].toTensor();
        c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
        at::NoGradGuard no_grad;
        x_cast = Float8Operand{float8_data(x2, scale, r.input_for_grad_weight.type, cublas_layouts(g)), scale};
      }
      gw = float8_mm(g.t(), x2, r.grad_output_for_grad_weight, r.input_for_grad_weight, w.scalar_type(), r,
                     max_for(s, "MN", 'M', r.grad_output_for_grad_weight), max_for(s, "MK", 'M', r.input_for_grad_weight),
                     false, x_cast ? &*x_cast : nullptr, g_t_cast ? &*g_t_cast : nullptr);
    }
    return {gx, gw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor float8_linear(const at::Tensor& x, const at::Tensor& weight, const Float8Recipe& recipe, const at::Tensor& kept,
                         const Float8Sharding* sharding, const Float8Weight* cast_weight) {
  TITAN_ASSERT(!cast_weight || recipe.name == "tensorwise", "a float8 weight cast beforehand needs the tensorwise recipe");
  // Under autocast the layer computes in the autocast dtype, as a Linear would (torchao's order:
  // the input is cast first, the weight is cast to float8 from its own dtype).
  // (A meta tensor takes the dtype of the device it stands for: compute_dtype.)
  const at::Tensor in = x.to(compute_dtype(x));
  return Float8LinearFn::apply(in, weight, reinterpret_cast<int64_t>(&recipe), std::optional<at::Tensor>(kept),
                               reinterpret_cast<int64_t>(sharding), reinterpret_cast<int64_t>(cast_weight));
}

Float8SharedInputs::Float8SharedInputs() : outer_(shared_inputs) { shared_inputs = this; }

Float8SharedInputs::~Float8SharedInputs() { shared_inputs = outer_; }

Float8SharedInputs::State& Float8SharedInputs::state() {
  if (!state_) state_ = std::make_unique<State>();
  return *state_;
}

namespace {

// Zero rows appended to `t` up to a multiple of `multiple` rows (none when it already is one).
at::Tensor pad_rows(const at::Tensor& t, int64_t multiple) {
  const int64_t rows = t.size(0), padded = (rows + multiple - 1) / multiple * multiple;
  if (padded == rows) return t;
  return at::cat({t, at::zeros({padded - rows, t.size(1)}, t.options())}, 0);
}

// f(expert, first row, rows) for every expert with tokens.
void for_each_group(const std::vector<int64_t>& counts, const std::function<void(int64_t, int64_t, int64_t)>& f) {
  int64_t begin = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] > 0) f(static_cast<int64_t>(e), begin, counts[e]);
    begin += counts[e];
  }
}

struct Float8GroupedLinearFn : public torch::autograd::Function<Float8GroupedLinearFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, std::vector<int64_t> counts,
                            int64_t recipe, int64_t padding) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["counts"] = counts;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["recipe"] = recipe;
    const Float8Recipe& r = *reinterpret_cast<const Float8Recipe*>(recipe);
    at::Tensor y = at::empty({x.size(0), w.size(1)}, x.options());
    for_each_group(counts, [&](int64_t e, int64_t begin, int64_t rows) {
      y.narrow(0, begin, rows)
          .copy_(float8_mm(x.narrow(0, begin, rows), w[e].t(), r.input, r.weight, x.scalar_type(), r, nullptr, nullptr,
                           /*fast_accum=*/true));
    });
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const std::vector<int64_t> counts = ctx->saved_data["counts"].toIntVector();
    const Float8Recipe& r = *reinterpret_cast<const Float8Recipe*>(ctx->saved_data["recipe"].toInt());
    const at::Tensor g = grads[0].contiguous();
    const bool want_x = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    at::Tensor gx = want_x ? at::zeros_like(x) : at::Tensor();
    at::Tensor gw = want_w ? at::zeros_like(w) : at::Tensor();
    // CUDA's float8 kernels need the summed dim in multiples of 16: the weight gradient sums over the
    // group's tokens, padded with zero rows (zeros change no amax and no sum).
    int64_t multiple = ctx->saved_data["padding"].toInt();
    if (multiple == 0) multiple = g.is_cuda() ? 16 : 1;
    for_each_group(counts, [&](int64_t e, int64_t begin, int64_t rows) {
      const at::Tensor g_e = g.narrow(0, begin, rows);
      if (want_x)
        gx.narrow(0, begin, rows).copy_(float8_mm(g_e, w[e], r.grad_output, r.weight_for_grad_input, x.scalar_type(), r));
      if (want_w)  // the scales over this group's tokens only
        gw[e].copy_(float8_mm(pad_rows(g_e, multiple).t(), pad_rows(x.narrow(0, begin, rows), multiple),
                              r.grad_output_for_grad_weight, r.input_for_grad_weight, w.scalar_type(), r));
    });
    return {gx, gw, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor float8_grouped_linear(const at::Tensor& x, const at::Tensor& w, const std::vector<int64_t>& counts,
                                 const Float8Recipe& recipe, int64_t padding) {
  TITAN_ASSERT(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2), "float8_grouped_linear: x (T, K), w (E, N, K)");
  TITAN_ASSERT(static_cast<int64_t>(counts.size()) == w.size(0) &&
                   std::accumulate(counts.begin(), counts.end(), int64_t{0}) == x.size(0),
               "float8_grouped_linear: the expert counts do not cover x's rows");
  return Float8GroupedLinearFn::apply(x, w, counts, reinterpret_cast<int64_t>(&recipe), padding);
}

}  // namespace titan::nn
