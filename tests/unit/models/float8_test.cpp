// Float8 linear layers (nn/float8.h) against an independent PyTorch reference written from
// torchao's recipes (tests/reference/float8_reference.py): for each recipe the output, the input's
// and the weight's gradients equal the reference's within fp32 rounding (2e-6 relative to each
// tensor's largest entry: the two sides cast alike, then multiply in a different order: float8
// products summed in fp32 and scaled afterwards, against dequantized values multiplied in fp64),
// with real float8 matmuls (at::_scaled_mm on the CPU) and emulated ones; and the float8 rounding
// is really there (the result is not the fp32 linear's).
#include "test_util.h"

#include "titan/common/autocast.h"
#include "titan/common/error.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/distributed/process_group.h"
#include "titan/nn/float8.h"
#include "titan/nn/fused_kernels.h"
#include "titan/nn/layers.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include <optional>
#include <thread>

namespace titan {
namespace {

const std::string kScript = std::string(TITAN_SOURCE_DIR) + "/tests/reference/float8_reference.py";

// A layer's x (M, K), W (N, K) and output gradient (M, N) with rows and columns of very different
// magnitudes, so that the scales along either dim differ from the tensor's (by more than the powers
// of 2 the rowwise recipes round them to).
struct LayerData {
  at::Tensor x, w, gy;
};
LayerData spread_layer(uint64_t seed, int64_t M, int64_t K, int64_t N) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto spread = [&](int64_t rows, int64_t cols) {
    return at::randn({rows, cols}, gen) * at::exp(2 * at::randn({rows, 1}, gen)) * at::exp(2 * at::randn({1, cols}, gen));
  };
  return {spread(M, K), spread(N, K) * 0.1, spread(M, N) * 1e-3};
}

TEST(Float8Linear, EveryRecipeEqualsTheReferenceWrittenFromIt) {
  const int64_t M = 48, K = 64, N = 32;
  const LayerData d = spread_layer(7, M, K, N);
  const at::Tensor &x0 = d.x, &w0 = d.w, &gy = d.gy;
  for (const std::string recipe_name : {"tensorwise", "rowwise", "rowwise_with_gw_hp"}) {
    SCOPED_TRACE(recipe_name);
    test::TempDir dir;
    safetensors::save(dir / "in.safetensors", {{"x", x0}, {"w", w0}, {"gy", gy}}, {{"recipe", recipe_name}});
    auto r = test::run_process({test::python(), kScript, dir / "in.safetensors", dir / "out.safetensors"},
                               {{"OMP_NUM_THREADS", "2"}});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto ref = safetensors::load(dir / "out.safetensors").tensors;
    for (const bool emulate : {false, true}) {
      SCOPED_TRACE(emulate ? "emulated" : "float8 matmuls");
      const nn::Float8Recipe recipe = nn::Float8Recipe::named(recipe_name, emulate);
      const at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
      const at::Tensor y = nn::float8_linear(x.view({4, 12, K}), w, recipe);  // (batch, seq, K) input
      EXPECT_EQ(y.sizes(), at::IntArrayRef({4, 12, N}));
      y.backward(gy.view({4, 12, N}));
      EXPECT_LT(test::relative_error(y.view({M, N}).detach(), ref.at("y")), 2e-6);
      EXPECT_LT(test::relative_error(x.grad(), ref.at("gx")), 2e-6);
      EXPECT_LT(test::relative_error(w.grad(), ref.at("gw")), 2e-6);
      // The float8 rounding shows: e4m3 keeps 3 mantissa bits.
      EXPECT_GT(test::relative_error(y.view({M, N}).detach(), at::linear(x0, w0)), 1e-3);
      if (recipe_name == "rowwise_with_gw_hp")  // the weight's gradient in high precision
        EXPECT_LT(test::relative_error(w.grad(), at::mm(gy.t(), x0)), 1e-6);
      else
        EXPECT_GT(test::relative_error(w.grad(), at::mm(gy.t(), x0)), 1e-3);
    }
    // The scales: tensorwise one per tensor; rowwise one per row along K, powers of 2.
    const nn::Float8Recipe recipe = nn::Float8Recipe::named(recipe_name);
    const nn::Float8Operand fx = nn::float8_cast(x0, recipe.input, 1, recipe.round_scales_to_power_of_2);
    EXPECT_TRUE(at::equal(fx.scale.reshape(ref.at("scale_x").sizes()), ref.at("scale_x")));
    EXPECT_EQ(fx.data.scalar_type(), at::kFloat8_e4m3fn);
    if (recipe.round_scales_to_power_of_2) {
      EXPECT_EQ(fx.scale.sizes(), at::IntArrayRef({M, 1}));
      EXPECT_TRUE(at::equal(fx.scale, at::exp2(at::round(at::log2(fx.scale)))));
    }
  }
}

// Tensor parallelism's splits (nn::Float8Sharding): two ranks (threads over Gloo) each hold their
// part of a layer split column-wise (N), row-wise (K) or by tokens (M); with the amaxes completed
// over the ranks their casts are one device's, so their outputs and gradients are the matching
// slices (or, where the split is the matmul's K, the partial sums) of the whole layer's, within fp32
// rounding. (Without the all-reduces the scales, hence the roundings, differ: 1e-2 relative.)
TEST(Float8Linear, SplitLayersCastAsOneDevice) {
  const int64_t M = 32, K = 64, N = 48;
  const LayerData d = spread_layer(3, M, K, N);
  const at::Tensor &x0 = d.x, &w0 = d.w, &gy = d.gy;
  for (const std::string recipe_name : {"tensorwise", "rowwise", "rowwise_with_gw_hp"}) {
    const nn::Float8Recipe recipe = nn::Float8Recipe::named(recipe_name);
    const at::Tensor x = x0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    nn::float8_linear(x, w, recipe).backward(gy);
    const at::Tensor y = nn::float8_linear(x0, w0, recipe);
    for (const char dim : {'N', 'K', 'M'}) {
      SCOPED_TRACE(recipe_name + " split along " + std::string(1, dim));
      auto store = c10::make_intrusive<c10d::HashStore>();
      std::vector<at::Tensor> ys(2), gxs(2), gws(2);
      auto rank_fn = [&](int rank) {
        auto backend = dist::make_backend(dist::BackendKind::Gloo, store, rank, 2, std::chrono::seconds(30));
        nn::Float8Sharding s;
        s.dim = dim;
        s.max_over_ranks = [&](at::Tensor& amax) {
          std::vector<at::Tensor> t = {amax};
          c10d::AllreduceOptions o;
          o.reduceOp = c10d::ReduceOp::MAX;
          backend->allreduce(t, o)->wait();
        };
        // This rank's x, w and gy: the halves along the split dim.
        auto half = [rank](const at::Tensor& t, int64_t d) { return t.chunk(2, d)[rank].contiguous(); };
        at::Tensor xr = dim == 'K' ? half(x0, 1) : dim == 'M' ? half(x0, 0) : x0.clone();
        at::Tensor wr = dim == 'N' ? half(w0, 0) : dim == 'K' ? half(w0, 1) : w0.clone();
        const at::Tensor gr = dim == 'N' ? half(gy, 1) : dim == 'M' ? half(gy, 0) : gy;
        xr.requires_grad_(true);
        wr.requires_grad_(true);
        const at::Tensor yr = nn::float8_linear(xr, wr, recipe, {}, &s);
        yr.backward(gr);
        ys[rank] = yr.detach();
        gxs[rank] = xr.grad();
        gws[rank] = wr.grad();
      };
      std::thread other(rank_fn, 1);
      rank_fn(0);
      other.join();
      // N: y, gw split along N, gx partial; K: y partial, gx and gw split along K; M: y, gx split
      // along M, gw partial.
      const at::Tensor y_all = dim == 'K' ? ys[0] + ys[1] : at::cat(ys, dim == 'N' ? 1 : 0);
      const at::Tensor gx_all = dim == 'N' ? gxs[0] + gxs[1] : at::cat(gxs, dim == 'K' ? 1 : 0);
      const at::Tensor gw_all = dim == 'M' ? gws[0] + gws[1] : at::cat(gws, dim == 'N' ? 0 : 1);
      EXPECT_LT(test::relative_error(y_all, y), 2e-6);
      EXPECT_LT(test::relative_error(gx_all, x.grad()), 2e-6);
      EXPECT_LT(test::relative_error(gw_all, w.grad()), 2e-6);
    }
  }
}

// The tensorwise recipe casts the weight alike for the output and for grad_input, and the input alike
// for the output and for grad_weight: the backward takes the forward's scales (no second amax, and
// under tensor parallelism no second all-reduce), with the same results as casting again. Counted
// through the sharding's all-reduce (one rank: the identity).
TEST(Float8Linear, TensorwiseBackwardTakesTheForwardsScales) {
  const LayerData d = spread_layer(5, 32, 64, 48);
  for (const std::string recipe_name : {"tensorwise", "rowwise"}) {
    const nn::Float8Recipe recipe = nn::Float8Recipe::named(recipe_name);
    for (const char dim : {'N', 'K'}) {
      SCOPED_TRACE(recipe_name + " split along " + std::string(1, dim));
      int calls = 0;
      nn::Float8Sharding s;
      s.dim = dim;
      s.max_over_ranks = [&](at::Tensor&) { ++calls; };
      const at::Tensor x = d.x.clone().requires_grad_(true), w = d.w.clone().requires_grad_(true);
      const at::Tensor y = nn::float8_linear(x, w, recipe, {}, &s);
      const int forward_calls = calls;
      y.backward(d.gy);
      const int backward_calls = calls - forward_calls;
      // Forward: the weight (split either way), and x when split along K. Backward, tensorwise: the
      // output gradient when split along N (its cast shared by both products); neither the weight
      // nor x again. Rowwise: only the scales along a split K (the weight's for grad_input: K of
      // gy @ W is N).
      if (recipe_name == "tensorwise") {
        EXPECT_EQ(forward_calls, dim == 'K' ? 2 : 1);
        EXPECT_EQ(backward_calls, dim == 'N' ? 1 : 0);
      } else {
        EXPECT_EQ(forward_calls, dim == 'K' ? 2 : 0);
        EXPECT_EQ(backward_calls, dim == 'N' ? 2 : 0);
      }
      // The same values as the layer without the split (the amaxes are this rank's alone either way).
      const at::Tensor x1 = d.x.clone().requires_grad_(true), w1 = d.w.clone().requires_grad_(true);
      const at::Tensor y1 = nn::float8_linear(x1, w1, recipe);
      y1.backward(d.gy);
      EXPECT_TRUE(at::equal(y, y1));
      EXPECT_TRUE(at::equal(x.grad(), x1.grad()));
      EXPECT_TRUE(at::equal(w.grad(), w1.grad()));
      // grad_input and grad_weight equal the products with the weight and x cast afresh (amaxes and
      // scales recomputed).
      EXPECT_TRUE(at::equal(x.grad(), nn::float8_mm(d.gy, d.w, recipe.grad_output, recipe.weight_for_grad_input,
                                                    at::kFloat, recipe)));
      EXPECT_TRUE(at::equal(w.grad(), nn::float8_mm(d.gy.t(), d.x, recipe.grad_output_for_grad_weight,
                                                    recipe.input_for_grad_weight, at::kFloat, recipe)));
      // Under per-operator checkpointing the forward returns the kept output without casting: the
      // backward casts the weight itself (and all-reduces its amax), with the same gradients.
      calls = 0;
      const at::Tensor x2 = d.x.clone().requires_grad_(true), w2 = d.w.clone().requires_grad_(true);
      const at::Tensor y2 = nn::float8_linear(x2, w2, recipe, y1.detach(), &s);
      EXPECT_EQ(calls, 0);
      y2.backward(d.gy);
      if (recipe_name == "tensorwise") {  // the output gradient's (N) or x's (K), and the weight's
        EXPECT_EQ(calls, 2);
      }
      EXPECT_TRUE(at::equal(x2.grad(), x1.grad()));
      EXPECT_TRUE(at::equal(w2.grad(), w1.grad()));
    }
  }
}

// Within a Float8SharedInputs scope, layers on the same input (attention's wq, wk, wv) cast it once:
// counted through the input's amax all-reduce (a row-wise split: x holds the split K), three layers
// take one input cast and three weight casts, with outputs and gradients bit for bit those of the
// layers without the scope. An input changed in place (its version) or cast otherwise (another
// recipe, another amax reduction) is cast again; a scope's casts end with it; scopes nest.
TEST(Float8Linear, LayersOnOneInputShareItsCastWithinAScope) {
  const LayerData d = spread_layer(7, 32, 64, 48);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(8);
  const std::vector<at::Tensor> ws = {d.w, at::randn({16, 64}, gen) * 0.3, at::randn({16, 64}, gen) * 3};
  for (const std::string recipe_name : {"tensorwise", "rowwise"}) {
    SCOPED_TRACE(recipe_name);
    const nn::Float8Recipe recipe = nn::Float8Recipe::named(recipe_name);
    int calls = 0;
    nn::Float8Sharding s;
    s.dim = 'K';
    s.max_over_ranks = [&](at::Tensor&) { ++calls; };
    // The three layers with the scope, then without it.
    auto run = [&](bool shared, std::vector<at::Tensor>& w_grads, at::Tensor& x_grad) {
      const at::Tensor x = d.x.clone().requires_grad_(true);
      std::vector<at::Tensor> w, y;
      calls = 0;
      {
        std::optional<nn::Float8SharedInputs> scope;
        if (shared) scope.emplace();
        for (const at::Tensor& wi : ws) {
          w.push_back(wi.clone().requires_grad_(true));
          y.push_back(nn::float8_linear(x, w.back(), recipe, {}, &s));
        }
      }
      const int forward_calls = calls;
      at::Tensor loss = at::zeros({}, at::kFloat);
      for (size_t i = 0; i < y.size(); ++i)
        loss = loss + (y[i] * at::linspace(-1, 1, y[i].numel()).view(y[i].sizes())).sum();
      loss.backward();
      for (const at::Tensor& wi : w) w_grads.push_back(wi.grad());
      x_grad = x.grad();
      return std::make_pair(forward_calls, y);
    };
    std::vector<at::Tensor> gw_shared, gw_alone;
    at::Tensor gx_shared, gx_alone;
    const auto [calls_shared, y_shared] = run(true, gw_shared, gx_shared);
    const auto [calls_alone, y_alone] = run(false, gw_alone, gx_alone);
    // Without the scope each layer all-reduces x's amax and its weight's; with it x's once.
    // (Rowwise: x's scales are along K, the split dim; the weight's too.)
    EXPECT_EQ(calls_alone, 6);
    EXPECT_EQ(calls_shared, 4);
    for (size_t i = 0; i < ws.size(); ++i) {
      EXPECT_TRUE(at::equal(y_shared[i], y_alone[i])) << i;
      EXPECT_TRUE(at::equal(gw_shared[i], gw_alone[i])) << i;
    }
    EXPECT_TRUE(at::equal(gx_shared, gx_alone));
  }
  // What a scope does not share.
  const nn::Float8Recipe tensorwise = nn::Float8Recipe::named("tensorwise"), rowwise = nn::Float8Recipe::named("rowwise");
  int calls = 0;
  nn::Float8Sharding s, other;
  s.dim = other.dim = 'K';
  s.max_over_ranks = other.max_over_ranks = [&](at::Tensor&) { ++calls; };
  at::NoGradGuard no_grad;
  nn::Float8SharedInputs scope;
  at::Tensor x = d.x.clone();
  const at::Tensor first = nn::float8_linear(x, d.w, tensorwise, {}, &s);
  EXPECT_EQ(calls, 2);
  x.mul_(4);  // changed in place: cast again (the result is not the first one's)
  const at::Tensor changed = nn::float8_linear(x, d.w, tensorwise, {}, &s);
  EXPECT_EQ(calls, 4);
  EXPECT_FALSE(at::equal(changed, first));
  {
    nn::Float8SharedInputs inner;  // a nested scope casts on its own, then shares within itself
    nn::float8_linear(x, d.w, tensorwise, {}, &s);
    EXPECT_EQ(calls, 6);
    nn::float8_linear(x, d.w, tensorwise, {}, &s);
    EXPECT_EQ(calls, 7);
  }
  nn::float8_linear(x, d.w, tensorwise, {}, &s);  // the outer scope's cast of the changed x
  EXPECT_EQ(calls, 8);
  nn::float8_linear(x, d.w, tensorwise, {}, &other);  // another amax reduction
  EXPECT_EQ(calls, 10);
  const at::Tensor by_rows = nn::float8_linear(x, d.w, rowwise, {}, &s);  // another cast of x
  EXPECT_EQ(calls, 12);
  EXPECT_TRUE(at::equal(by_rows, nn::float8_linear(x, d.w, rowwise)));
}

// Attention's wq, wk and wv, and a feed-forward's w1 and w3, cast their common input once: counted
// through the input's amax all-reduce (every layer given one row-wise sharding, so that x's amax is
// reduced: its calls are the input casts plus one per weight). Attention: x once for its three
// projections, wo's input once, four weights (8 without the sharing). Feed-forward: x once for w1
// and w3, w2's input, three weights (6 without); its output bit for bit the layers applied alone.
TEST(Float8Linear, AttentionAndFeedForwardCastTheirCommonInputOnce) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(21);
  const int64_t B = 2, S = 16, D = 64, E = 16, F = 96;
  const auto recipe = std::make_shared<const nn::Float8Recipe>(nn::Float8Recipe::named("tensorwise"));
  int calls = 0;
  auto sharding = std::make_shared<nn::Float8Sharding>();
  sharding->dim = 'K';
  sharding->max_over_ranks = [&](at::Tensor&) { ++calls; };
  auto convert = [&](nn::Linear& l) {
    at::NoGradGuard no_grad;
    l->weight.copy_(at::randn(l->weight.sizes(), gen) * 0.1);
    l->float8 = recipe;
    l->float8_sharding = sharding;
  };
  nn::Attention attention(D, 4, 2, E, std::nullopt, at::TensorOptions().dtype(at::kFloat));
  for (nn::Linear* l : {&attention->wq, &attention->wk, &attention->wv, &attention->wo}) convert(*l);
  nn::FeedForward ffn(D, F, at::TensorOptions().dtype(at::kFloat));
  for (nn::Linear* l : {&ffn->w1, &ffn->w2, &ffn->w3}) convert(*l);
  const at::Tensor x = at::randn({B, S, D}, gen);
  const at::Tensor angles = at::outer(at::arange(S, at::kFloat), nn::rope_frequencies(E, 500000.0, std::nullopt));
  attention(x, at::polar(at::ones_like(angles), angles));
  EXPECT_EQ(calls, 6);
  calls = 0;
  const at::Tensor y = ffn(x);
  EXPECT_EQ(calls, 5);
  const at::Tensor alone = nn::float8_linear(
      nn::swiglu(nn::float8_linear(x, ffn->w1->weight, *recipe), nn::float8_linear(x, ffn->w3->weight, *recipe)),
      ffn->w2->weight, *recipe);
  EXPECT_TRUE(at::equal(y, alone));
}

TEST(Float8Linear, UnderAutocastTheInputIsCastAndTheProductsKeepTheirDtypes) {
  // Under bf16 autocast (CPU's standing in for CUDA's) the layer takes its input in bf16 and
  // returns bf16, and its products run in the dtypes the recipe says: the emulated product in fp32
  // (not autocast's bf16), exactly as the same layer on a bf16 input without autocast.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(13);
  const at::Tensor x = at::randn({32, 64}, gen), w = at::randn({48, 64}, gen) * 0.1;
  for (const std::string recipe_name : {"tensorwise", "rowwise"}) {
    const nn::Float8Recipe recipe = nn::Float8Recipe::named(recipe_name, /*emulate=*/true);
    at::Tensor under_autocast;
    {
      Bf16Autocast autocast(at::kCPU, true);
      under_autocast = nn::float8_linear(x, w, recipe);
    }
    EXPECT_EQ(under_autocast.scalar_type(), at::kBFloat16) << recipe_name;
    EXPECT_TRUE(at::equal(under_autocast, nn::float8_linear(x.to(at::kBFloat16), w, recipe))) << recipe_name;
  }
}

TEST(Float8Linear, TensorwiseScaleFollowsTheFormula) {
  // amax 3.5: scale 448 / 3.5 = 128 (e4m3), 57344 / 3.5 = 16384 (e5m2); saturating at the max.
  const at::Tensor t = at::tensor({1.0f, -3.5f, 0.25f, 2.0f}).view({2, 2});
  const nn::Float8Operand a = nn::float8_cast(t, {nn::Float8Type::E4M3, nn::Float8Scaling::Tensorwise}, 1, false);
  EXPECT_FLOAT_EQ(a.scale.item<float>(), 128.0f);
  EXPECT_TRUE(at::equal(a.data.to(at::kFloat), t * 128));
  const nn::Float8Operand b = nn::float8_cast(t, {nn::Float8Type::E5M2, nn::Float8Scaling::Tensorwise}, 1, false);
  EXPECT_FLOAT_EQ(b.scale.item<float>(), 16384.0f);
  // An all-zero tensor: the amax is clamped at 1e-12 (no division by zero).
  const nn::Float8Operand z = nn::float8_cast(at::zeros({2, 2}), {nn::Float8Type::E4M3, nn::Float8Scaling::Tensorwise}, 1, false);
  EXPECT_TRUE(at::isfinite(z.scale).item<bool>());
  EXPECT_TRUE(at::equal(z.data.to(at::kFloat), at::zeros({2, 2})));
}

// MoE experts' grouped float8 matmuls: every expert's block of rows is that expert's rowwise float8
// linear layer (checked against the reference above), with the weight gradient's scales over the
// expert's own tokens (the jagged scales of a grouped GEMM). So the grouped layer's output and both
// gradients equal, bit for bit, each expert's float8 layer applied to its own rows alone; an expert
// without tokens gets a zero gradient. Against the same with one scale over all experts' tokens the
// weight gradients differ (the scales really are per group). The same with every group padded with
// zero rows to 16 for the weight gradient's product, as on CUDA.
TEST(Float8Linear, GroupedExpertsAreEachExpertsOwnRowwiseLayer) {
 for (const int64_t padding : {0, 16}) {
  SCOPED_TRACE("padding " + std::to_string(padding));
  const nn::Float8Recipe rowwise = nn::Float8Recipe::named("rowwise");
  const int64_t E = 4, K = 32, N = 48;
  const std::vector<int64_t> counts = {5, 0, 17, 10};  // an expert without tokens
  const int64_t T = 32;
  const LayerData d = spread_layer(7, T, K, N);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(11);
  // Experts' weights of very different magnitudes.
  const at::Tensor w = (at::randn({E, N, K}, gen) * at::exp(2 * at::randn({E, N, 1}, gen))).requires_grad_(true);
  const at::Tensor x = d.x.clone().requires_grad_(true);
  const at::Tensor y = nn::float8_grouped_linear(x, w, counts, rowwise, padding);
  y.backward(d.gy);

  int64_t begin = 0;
  for (int64_t e = 0; e < E; ++e) {
    SCOPED_TRACE("expert " + std::to_string(e));
    if (counts[e] == 0) {
      EXPECT_TRUE(at::equal(w.grad()[e], at::zeros({N, K}))) << "an expert without tokens has no gradient";
      continue;
    }
    const at::Tensor xe = d.x.narrow(0, begin, counts[e]).clone().requires_grad_(true);
    const at::Tensor we = w.detach()[e].clone().requires_grad_(true);
    const at::Tensor ye = nn::float8_linear(xe, we, rowwise);
    ye.backward(d.gy.narrow(0, begin, counts[e]));
    EXPECT_TRUE(at::equal(y.narrow(0, begin, counts[e]), ye));
    EXPECT_TRUE(at::equal(x.grad().narrow(0, begin, counts[e]), xe.grad()));
    EXPECT_TRUE(at::equal(w.grad()[e], we.grad()));
    begin += counts[e];
  }
  // Expert 2's weight gradient with the input's scales taken over every token instead (the output
  // gradient zero outside its rows, so the product is the same sum): not the grouped layer's.
  const at::Tensor mask = at::zeros({T, 1});
  mask.narrow(0, 5, 17).fill_(1);
  const at::Tensor gw_all_tokens = nn::float8_mm((d.gy * mask).t(), d.x, rowwise.grad_output_for_grad_weight,
                                                 rowwise.input_for_grad_weight, at::kFloat, rowwise);
  EXPECT_FALSE(at::equal(gw_all_tokens, w.grad()[2]));
  EXPECT_TRUE(at::allclose(gw_all_tokens, w.grad()[2], 0.2, 1e-3 * w.grad()[2].abs().max().item<double>()));
 }
}

TEST(Float8Linear, UnknownRecipeIsNamed) {
  const std::string e = test::error_of([] { nn::Float8Recipe::named("blockwise"); });
  EXPECT_NE(e.find("recipe_name \"blockwise\" is not a float8 recipe: choose tensorwise"), std::string::npos) << e;
}

// On a GPU (cuBLAS's float8 matmuls through at::_scaled_mm): each recipe's casts are the CPU's bit for
// bit (amaxes, scales, float8 values), and the layer's output and gradients equal the CPU's (the
// same float8 values multiplied in fp32) within the GPU's accumulation: 1e-3 of each tensor's largest
// entry where the product is written in the input's fp32 (tensorwise: its forward accumulates with
// cuBLAS's fast float8 accumulation), 5e-3 where cuBLAS writes rowwise products in bf16 (half a bf16
// unit is up to 2^-8 = 3.9e-3 of an entry). Then the grouped layer of MoE experts (groups padded to 16 rows on the GPU) against the CPU
// padded alike.
// The CPU writes a column-major cast when asked (the same values), and the meta device (titan
// estimate's dry run of a CUDA run) allocates what CUDA's cast kernel does: the float8 output in the
// layout cuBLAS takes, no fp32 copies.
TEST(Float8Linear, ColumnMajorCastsHoldTheSameValuesAndMetaTakesTheKernelsLayout) {
  const LayerData d = spread_layer(3, 40, 24, 8);
  const nn::Float8Recipe recipe = nn::Float8Recipe::named("rowwise");
  for (const auto& [t, k_dim] : std::vector<std::pair<at::Tensor, int64_t>>{{d.x, 1}, {d.w.t(), 0}, {d.x.t(), 0}}) {
    const nn::Float8Operand rows = nn::float8_cast(t, recipe.input, k_dim, true, nullptr, false);
    const nn::Float8Operand cols = nn::float8_cast(t, recipe.input, k_dim, true, nullptr, true);
    EXPECT_TRUE(rows.data.is_contiguous());
    EXPECT_TRUE(cols.data.t().is_contiguous());
    EXPECT_TRUE(at::equal(rows.data.view(at::kByte), cols.data.contiguous().view(at::kByte)));
    EXPECT_TRUE(at::equal(rows.scale, cols.scale));
    for (const bool column_major : {false, true}) {
      const at::Tensor meta = t.to(at::kMeta).to(at::kBFloat16);
      const at::Tensor data = nn::float8_cast(meta, recipe.input, k_dim, true, nullptr, column_major).data;
      EXPECT_EQ(data.scalar_type(), at::kFloat8_e4m3fn);
      EXPECT_EQ(data.sizes(), t.sizes());
      EXPECT_TRUE(column_major ? data.t().is_contiguous() : data.is_contiguous());
    }
  }
}

TEST(CudaFloat8, EveryRecipeOnTheGpuEqualsTheCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible: this check runs only on a GPU machine";
  const int64_t M = 64, K = 64, N = 32;
  const LayerData d = spread_layer(11, M, K, N);
  const at::Device cuda(at::kCUDA);
  for (const std::string recipe_name : {"tensorwise", "rowwise", "rowwise_with_gw_hp"}) {
    SCOPED_TRACE(recipe_name);
    const nn::Float8Recipe recipe = nn::Float8Recipe::named(recipe_name);
    for (const auto& [t, k_dim] : std::vector<std::pair<at::Tensor, int64_t>>{{d.x, 1}, {d.w.t(), 0}}) {
      const nn::Float8Operand cpu = nn::float8_cast(t, recipe.input, k_dim, recipe.round_scales_to_power_of_2);
      const nn::Float8Operand gpu = nn::float8_cast(t.to(cuda), recipe.input, k_dim, recipe.round_scales_to_power_of_2);
      EXPECT_TRUE(at::equal(gpu.scale.cpu(), cpu.scale));
      EXPECT_TRUE(at::equal(gpu.data.cpu().view(at::kByte), cpu.data.view(at::kByte)));
    }
    auto run = [&](const at::Device& device) {
      const at::Tensor x = d.x.detach().to(device).requires_grad_(true);
      const at::Tensor w = d.w.detach().to(device).requires_grad_(true);
      const at::Tensor y = nn::float8_linear(x, w, recipe);
      y.backward(d.gy.to(device));
      EXPECT_EQ(y.scalar_type(), at::kFloat);
      return std::vector<at::Tensor>{y.detach().cpu(), x.grad().cpu(), w.grad().cpu()};
    };
    const auto cpu = run(at::kCPU), gpu = run(cuda);
    const double tol = recipe_name == "tensorwise" ? 1e-3 : 5e-3;
    EXPECT_LT(test::relative_error(gpu[0], cpu[0]), tol);
    EXPECT_LT(test::relative_error(gpu[1], cpu[1]), tol);
    EXPECT_LT(test::relative_error(gpu[2], cpu[2]), recipe_name == "rowwise_with_gw_hp" ? 1e-5 : tol);
    EXPECT_GT(test::relative_error(gpu[0], at::linear(d.x, d.w)), 1e-3) << "the float8 rounding shows";
  }
  const nn::Float8Recipe rowwise = nn::Float8Recipe::named("rowwise");
  const std::vector<int64_t> counts = {5, 0, 17, 42};  // an expert without tokens; none a multiple of 16
  const LayerData g = spread_layer(5, 64, 32, 48);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(13);
  const at::Tensor w0 = at::randn({4, 48, 32}, gen) * at::exp(2 * at::randn({4, 48, 1}, gen));
  auto grouped = [&](const at::Device& device, int64_t padding) {
    const at::Tensor x = g.x.detach().to(device).requires_grad_(true);
    const at::Tensor w = w0.detach().to(device).requires_grad_(true);
    const at::Tensor y = nn::float8_grouped_linear(x, w, counts, rowwise, padding);
    y.backward(g.gy.to(device));
    return std::vector<at::Tensor>{y.detach().cpu(), x.grad().cpu(), w.grad().cpu()};
  };
  const auto cpu = grouped(at::kCPU, 16), gpu = grouped(cuda, 0);
  for (size_t i = 0; i < 3; ++i) EXPECT_LT(test::relative_error(gpu[i], cpu[i]), 5e-3) << "tensor " << i;
  EXPECT_TRUE(at::equal(gpu[2][1], at::zeros({48, 32}))) << "an expert without tokens has no gradient";
}

// titan's float8 cast kernel (fused_kernels.h) against ATen's formulation of the cast on the CPU,
// bit for bit: every input dtype, inputs row-major, transposed and strided, both output layouts,
// scales of one value, per row and per column, both float8 types, sizes that are not multiples of
// the kernel's 32 x 32 tiles, values past float8's range (clamped), below its normal range
// (subnormals) and signed zeros.
TEST(CudaFloat8, CastKernelEqualsAtensCastInEveryLayoutAndDtype) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible: this check runs only on a GPU machine";
  const at::Device cuda(at::kCUDA);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(17);
  auto aten_cast = [](const at::Tensor& t, const at::Tensor& scale, at::ScalarType fp8) {
    const double max = fp8 == at::kFloat8_e4m3fn ? 448.0 : 57344.0;
    return (t.to(at::kFloat) * scale).clamp(-max, max).to(fp8);
  };
  int checked = 0;
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    // (Sizes in multiples of 8 take the vectorized kernels, with partial 64 x 64 tiles in 72 x 40.)
    for (const auto& [R, C] :
         std::vector<std::pair<int64_t, int64_t>>{{37, 53}, {64, 96}, {72, 40}, {8, 136}, {1, 70}, {130, 5}}) {
      // Magnitudes from 1e-6 to 1e4 (below e4m3's subnormals, through them, past its maximum once scaled).
      const int64_t n = std::max(R, C);
      at::Tensor base = at::randn({n + 3, 2 * n}, gen) * at::pow(10.0, at::randint(-6, 5, {n + 3, 2 * n}, gen));
      base.index_put_({0, 0}, -0.0);
      base = base.to(dtype);
      const std::vector<std::pair<std::string, at::Tensor>> inputs = {
          {"row-major", base.narrow(0, 0, R).narrow(1, 0, C).contiguous()},
          {"strided rows", base.narrow(0, 2, R).narrow(1, 1, C)},
          {"transposed", base.narrow(0, 0, C).narrow(1, 0, R).contiguous().t()},
          {"every other column", base.narrow(0, 0, R).slice(1, 0, 2 * C, 2)},
          {"aligned block", base.narrow(0, 3, R).narrow(1, 8, C)},
          {"aligned block transposed", base.narrow(0, 3, C).narrow(1, 8, R).t()}};
      for (const auto& [layout, t] : inputs) {
        ASSERT_EQ(t.sizes(), at::IntArrayRef({R, C}));
        const std::vector<at::Tensor> scales = {at::full({}, 0.37f), at::rand({R, 1}, gen) * 8, at::rand({1, C}, gen) * 8};
        for (size_t s = 0; s < scales.size(); ++s) {
          for (const at::ScalarType fp8 : {at::kFloat8_e4m3fn, at::kFloat8_e5m2}) {
            const at::Tensor want = aten_cast(t, scales[s], fp8).view(at::kByte);
            const at::Tensor t_gpu = t.to(cuda), scale_gpu = scales[s].to(cuda);
            ASSERT_TRUE(nn::fused::float8_cast_accepts(t_gpu, scale_gpu));
            for (const bool column_major : {false, true}) {
              SCOPED_TRACE(std::string(c10::toString(dtype)) + " " + std::to_string(R) + "x" + std::to_string(C) + " " +
                           layout + " scale " + std::to_string(s) + " " + c10::toString(fp8) +
                           (column_major ? " column-major" : " row-major"));
              const at::Tensor got = nn::fused::float8_cast(t_gpu, scale_gpu, fp8, column_major);
              EXPECT_EQ(got.scalar_type(), fp8);
              EXPECT_EQ(got.sizes(), t.sizes());
              EXPECT_TRUE(column_major ? got.t().is_contiguous() : got.is_contiguous());
              EXPECT_TRUE(at::equal(got.cpu().view(at::kByte), want));
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 3 * 6 * 6 * 3 * 2 * 2);
  // The saturation and the subnormals are really exercised (e4m3's max 448 = 0x7e; smallest subnormal 0x01).
  const at::Tensor t = at::tensor({1000.0f, -1000.0f, 0.002f, -0.0f, 3.0f}).reshape({1, 5});
  const at::Tensor one = at::ones({});
  const at::Tensor got = nn::fused::float8_cast(t.to(cuda), one.to(cuda), at::kFloat8_e4m3fn, false).cpu().view(at::kByte);
  EXPECT_TRUE(at::equal(got, at::tensor({0x7e, 0xfe, 0x01, 0x80, 0x44}, at::kByte).reshape({1, 5}))) << got;
  // A 1-D tensor (FSDP's float8 shards) in rows of 32 and, for other lengths, the rest as one row;
  // strided; large enough that the kernels' blocks loop over several tiles.
  for (const int64_t n : {int64_t{96}, int64_t{50}, int64_t{20}, (int64_t{1} << 25) + 48}) {
    const at::Tensor v = at::randn({n}, gen).to(at::kBFloat16);
    const at::Tensor got1 = nn::fused::float8_cast(v.to(cuda), at::full({}, 100.0f, at::kFloat).to(cuda), at::kFloat8_e4m3fn, false);
    EXPECT_TRUE(at::equal(got1.cpu().view(at::kByte), aten_cast(v, at::full({}, 100.0f), at::kFloat8_e4m3fn).view(at::kByte)))
        << n;
  }
  {
    const at::Tensor v = at::randn({2 * 1000 + 1}, gen).slice(0, 0, 2001, 2);  // 1001 values, stride 2
    const at::Tensor got2 = nn::fused::float8_cast(v.to(cuda), at::full({}, 3.0f).to(cuda), at::kFloat8_e5m2, false);
    EXPECT_TRUE(at::equal(got2.cpu().view(at::kByte), aten_cast(v, at::full({}, 3.0f), at::kFloat8_e5m2).view(at::kByte)));
  }
  // 2-D casts of ~17 million values, both layouts from either input layout (blocks loop over tiles).
  for (const bool transposed : {false, true}) {
    const at::Tensor big = transposed ? at::randn({8200, 2056}, gen).to(at::kBFloat16).t() : at::randn({2056, 8200}, gen).to(at::kBFloat16);
    const at::Tensor want = aten_cast(big, at::full({}, 50.0f), at::kFloat8_e4m3fn).view(at::kByte);
    for (const bool column_major : {false, true}) {
      const at::Tensor got3 = nn::fused::float8_cast(big.to(cuda), at::full({}, 50.0f).to(cuda), at::kFloat8_e4m3fn, column_major);
      EXPECT_TRUE(at::equal(got3.cpu().contiguous().view(at::kByte), want.contiguous())) << transposed << column_major;
    }
  }
  // Infinities clamp to the largest float8 value; NaN stays NaN (0x7f); in every kernel.
  for (const int64_t C : {int64_t{8}, int64_t{5}}) {
    at::Tensor special = at::randn({16, C}, gen);
    special.index_put_({0, 0}, std::numeric_limits<float>::infinity());
    special.index_put_({1, 1}, -std::numeric_limits<float>::infinity());
    special.index_put_({2, 2}, std::numeric_limits<float>::quiet_NaN());
    for (const at::ScalarType fp8 : {at::kFloat8_e4m3fn, at::kFloat8_e5m2})
      for (const bool column_major : {false, true}) {
        const at::Tensor got4 = nn::fused::float8_cast(special.to(cuda), at::ones({}).to(cuda), fp8, column_major);
        EXPECT_TRUE(at::equal(got4.cpu().contiguous().view(at::kByte), aten_cast(special, at::ones({}), fp8).view(at::kByte)))
            << C << " " << c10::toString(fp8) << " " << column_major;
      }
  }
  // A scale the kernel does not take: a 1-D one over a 2-D tensor would broadcast along the columns.
  EXPECT_FALSE(nn::fused::float8_cast_accepts(at::ones({4, 4}, cuda), at::ones({4}, cuda)));
  EXPECT_FALSE(nn::fused::float8_cast_accepts(at::ones({4, 4}), at::ones({}))) << "a CPU tensor";
  EXPECT_FALSE(nn::fused::float8_cast_accepts(at::ones({4}, cuda), at::ones({1, 1}, cuda))) << "a scale of higher rank";
}

}  // namespace
}  // namespace titan
