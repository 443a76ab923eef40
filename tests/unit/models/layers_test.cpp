// The memory-lean layers of titan/nn/layers.h against their plain ATen formulations (the
// layers as first written: at::rms_norm, complex RoPE through autograd, K/V repeated for grouped-query
// attention, silu(h1) * h3 through autograd).
//
// Numerics: outputs are bitwise the plain ones where the forward runs the same kernels in the same
// order (RMSNorm and SwiGLU; RoPE rotates in place, which is the same kernel). Gradients:
//   fp32: 1e-6 relative to the tensor's scale (max |a - b| / max |b|): the written-out backward passes
//     round differently from autograd's chain, at ~1e-7.
//   bf16: 1e-2. Both sides compute in fp32 and round the result to bf16 once (8 mantissa bits: one
//     unit in the last place is up to 2^-7 = 7.8e-3 of an element); an fp32 difference of 1e-7 can
//     flip that rounding.
// Grouped-query attention reads K/V heads in place where the plain form copies them; the flash kernel
// then sums the K/V gradients of a group inside the kernel, in fp32, where the plain form rounds each
// of the group's H/K per-head gradients to bf16 and adds those: fp32 1e-5; bf16 2e-2 (up to H/K = 8
// roundings of 2^-9 each; measured up to 1.1e-2 over 50 random draws, 4e-3 to 8e-3 typically).
//
// Memory (measured with the counting CPU allocator, tests/unit/models/graph_memory.h): each lean
// layer saves, or peaks at, a stated fraction of what its plain formulation does. Each bound fails
// when the lean layer is replaced by its plain formulation.
#include "models/graph_memory.h"
#include "models/tiny_llama.h"
#include "test_util.h"

#include "titan/common/autocast.h"
#include "titan/nn/layers.h"
#include "titan/models/llama3/model.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>

#include <cstdio>
#include <optional>

namespace titan {
namespace {

using test::GraphFn;

// ---------------------------------------------------------------------------------------------
// The plain formulations.

at::Tensor plain_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return at::rms_norm(x, {w.size(0)}, w, eps);
}

at::Tensor plain_rope(const at::Tensor& x_BSnE, const at::Tensor& cis_SE2) {
  const auto B = x_BSnE.size(0), S = x_BSnE.size(1), n = x_BSnE.size(2), E = x_BSnE.size(3);
  at::Tensor x_c = at::view_as_complex(x_BSnE.to(at::kFloat).reshape({B, S, n, E / 2, 2}));
  return at::view_as_real(x_c * cis_SE2.view({1, S, 1, E / 2})).flatten(3).to(x_BSnE.scalar_type());
}

at::Tensor plain_attention(const at::Tensor& q_BHSE, const at::Tensor& k_BKSE, const at::Tensor& v_BKSE) {
  const auto B = k_BKSE.size(0), K = k_BKSE.size(1), S = k_BKSE.size(2), E = k_BKSE.size(3), H = q_BHSE.size(1);
  auto repeat = [&](const at::Tensor& t) { return t.unsqueeze(2).expand({B, K, H / K, S, E}).reshape({B, H, S, E}); };
  return at::scaled_dot_product_attention(q_BHSE, repeat(k_BKSE), repeat(v_BKSE), {}, 0.0, /*is_causal=*/true);
}

at::Tensor plain_swiglu(const at::Tensor& h1, const at::Tensor& h3) { return at::silu(h1) * h3; }

at::Tensor rope_table(int64_t S, int64_t E) {
  at::Tensor angles = at::outer(at::arange(S, at::kFloat), nn::rope_frequencies(E, 500000.0, std::nullopt));
  return at::polar(at::ones_like(angles), angles);
}

// A Llama 3 block in the plain formulations, with `b`'s weights.
at::Tensor plain_block(llama3::TransformerBlock& b, const at::Tensor& x_BSD, const at::Tensor& cis_SE2) {
  const auto B = x_BSD.size(0), S = x_BSD.size(1), E = b->attention->head_dim;
  const auto& att = b->attention;
  const auto& ff = b->feed_forward;
  at::Tensor xn = plain_rms_norm(x_BSD, b->attention_norm->weight, b->attention_norm->eps);
  at::Tensor q = plain_rope(at::linear(xn, att->wq->weight).view({B, S, -1, E}), cis_SE2).transpose(1, 2);
  at::Tensor k = plain_rope(at::linear(xn, att->wk->weight).view({B, S, -1, E}), cis_SE2).transpose(1, 2);
  at::Tensor v = at::linear(xn, att->wv->weight).view({B, S, -1, E}).transpose(1, 2);
  at::Tensor o = plain_attention(q, k, v).transpose(1, 2).contiguous().view({B, S, -1});
  at::Tensor h = x_BSD + at::linear(o, att->wo->weight);
  at::Tensor hn = plain_rms_norm(h, b->ffn_norm->weight, b->ffn_norm->eps);
  return h + at::linear(plain_swiglu(at::linear(hn, ff->w1->weight), at::linear(hn, ff->w3->weight)), ff->w2->weight);
}

llama3::TransformerBlock make_block(at::ScalarType dt) {
  llama3::ModelArgs a = test::tiny_llama(1, 101, 64);
  a.dim = 256;  // 4 heads of 64 over 2 key/value heads; SwiGLU hidden 704
  llama3::Transformer model(a, at::TensorOptions().dtype(dt));
  model->init_weights(3);
  return llama3::TransformerBlock(std::dynamic_pointer_cast<llama3::TransformerBlockImpl>(model->layers["0"]));
}

// CPU bf16 autocast while alive (standing in for CUDA's: matmuls and attention in bf16, the rest as is).
struct CpuBf16Autocast : Bf16Autocast {
  CpuBf16Autocast() : Bf16Autocast(at::kCPU, true) {}
};

// ---------------------------------------------------------------------------------------------
// Output and input gradients of f at `inputs` (fresh leaves; integer inputs get no gradient).

struct Result {
  at::Tensor out;
  std::vector<at::Tensor> grads;
};

Result run(const GraphFn& f, const std::vector<at::Tensor>& inputs, const at::Tensor& grad_out) {
  std::vector<at::Tensor> in, wrt;
  for (const auto& x : inputs) {
    in.push_back(x.detach().clone().requires_grad_(x.is_floating_point()));
    if (x.is_floating_point()) wrt.push_back(in.back());
  }
  Result r;
  r.out = f(in);
  r.grads = torch::autograd::grad({r.out}, wrt, {grad_out});
  r.out = r.out.detach();
  return r;
}

// Compares lean and plain: outputs bitwise (when `same_forward`) or within tol, gradients within tol.
void expect_same(const std::string& what, const GraphFn& lean, const GraphFn& plain,
                 const std::vector<at::Tensor>& inputs, bool same_forward, double tol) {
  at::Tensor probe = plain(inputs);
  at::Tensor grad_out = at::randn(probe.sizes(), probe.options());
  Result a = run(lean, inputs, grad_out), b = run(plain, inputs, grad_out);
  ASSERT_EQ(a.out.scalar_type(), b.out.scalar_type()) << what;
  if (same_forward) {
    EXPECT_TRUE(at::equal(a.out, b.out)) << what << ": output differs by " << test::relative_error(a.out, b.out);
  } else {
    EXPECT_LE(test::relative_error(a.out, b.out), tol) << what << " output";
  }
  double worst = 0;
  for (size_t i = 0; i < b.grads.size(); ++i) {
    ASSERT_EQ(a.grads[i].scalar_type(), b.grads[i].scalar_type()) << what;
    const double err = test::relative_error(a.grads[i], b.grads[i]);
    worst = std::max(worst, err);
    EXPECT_LE(err, tol) << what << " gradient of input " << i;
  }
  std::printf("[%s] output %s, worst gradient relative error %.2e\n", what.c_str(),
              at::equal(a.out, b.out) ? "bitwise equal" : "close", worst);
}

at::Tensor randn(at::IntArrayRef shape, at::ScalarType dt) { return at::randn(shape).to(dt); }

// ---------------------------------------------------------------------------------------------
// Numerics.

TEST(LeanLayers, RmsNormEqualsATenRmsNorm) {
  at::manual_seed(0);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    const double tol = dt == at::kFloat ? 1e-6 : 1e-2;
    at::Tensor x = randn({2, 16, 64}, dt) * 3, w = randn({64}, dt);
    expect_same(std::string("rms_norm ") + at::toString(dt),
                [](const auto& in) { return nn::rms_norm(in[0], in[1], 1e-5); },
                [](const auto& in) { return plain_rms_norm(in[0], in[1], 1e-5); }, {x, w}, true, tol);
  }
  // bf16 activations with fp32 weights (what FSDP's bf16 compute never does, but the type allows).
  at::Tensor x = randn({2, 16, 64}, at::kBFloat16), w = at::randn({64});
  expect_same("rms_norm bf16 x, fp32 weight", [](const auto& in) { return nn::rms_norm(in[0], in[1], 1e-5); },
              [](const auto& in) { return plain_rms_norm(in[0], in[1], 1e-5); }, {x, w}, true, 1e-2);
}

// Under bf16 autocast (CPU autocast here, standing in for CUDA's) the norm returns bf16: bitwise what
// the next matmul's own cast of ATen's fp32 output gives.
TEST(LeanLayers, RmsNormUnderAutocastReturnsWhatTheNextMatmulWouldCastTo) {
  at::Tensor x = at::randn({2, 16, 64}) * 3, w = at::randn({64});
  at::Tensor lean, plain;
  {
    CpuBf16Autocast autocast;
    lean = nn::rms_norm(x, w, 1e-5);
    plain = plain_rms_norm(x, w, 1e-5);
  }
  EXPECT_EQ(lean.scalar_type(), at::kBFloat16);
  EXPECT_EQ(plain.scalar_type(), at::kFloat);
  EXPECT_TRUE(at::equal(lean, plain.to(at::kBFloat16)));
  EXPECT_EQ(nn::rms_norm(x, w, 1e-5).scalar_type(), at::kFloat);  // autocast off: x's dtype
}

TEST(LeanLayers, RopeEqualsComplexMultiplyThroughAutograd) {
  at::manual_seed(0);
  at::Tensor cis = rope_table(16, 32);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    const double tol = dt == at::kFloat ? 1e-6 : 1e-2;
    at::Tensor x = randn({2, 16, 3, 32}, dt);
    expect_same(std::string("rope ") + at::toString(dt), [&](const auto& in) { return nn::apply_rope(in[0], cis); },
                [&](const auto& in) { return plain_rope(in[0], cis); }, {x}, true, tol);
    // A non-contiguous input (a head slice of a wider projection) rotates the same.
    at::Tensor wide = randn({2, 16, 6, 32}, dt);
    expect_same(std::string("rope strided ") + at::toString(dt),
                [&](const auto& in) { return nn::apply_rope(in[0].slice(2, 0, 3), cis); },
                [&](const auto& in) { return plain_rope(in[0].slice(2, 0, 3), cis); }, {wide}, true, tol);
  }
}

TEST(LeanLayers, GroupedQueryAttentionEqualsRepeatedKeysAndValues) {
  at::manual_seed(0);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    const double tol = dt == at::kFloat ? 1e-5 : 2e-2;
    for (int64_t K : {2, 1, 8}) {  // 8 query heads over 2 (GQA), 1 (multi-query) and 8 (plain) key/value heads
      at::Tensor q = randn({2, 8, 24, 16}, dt), k = randn({2, K, 24, 16}, dt), v = randn({2, K, 24, 16}, dt);
      expect_same("attention " + std::string(at::toString(dt)) + " K=" + std::to_string(K),
                  [](const auto& in) { return nn::causal_attention(in[0], in[1], in[2]); },
                  [](const auto& in) { return plain_attention(in[0], in[1], in[2]); }, {q, k, v}, false, tol);
    }
  }
}

// Where SDPA has no fused kernel for the inputs it would run its math backend; causal_attention then
// repeats the heads itself (here: flash disabled, so the CPU has no fused kernel at all).
TEST(LeanLayers, GroupedQueryAttentionWithoutAFusedKernelStillEqualsRepeated) {
  at::manual_seed(0);
  at::globalContext().setSDPUseFlash(false);
  at::Tensor q = at::randn({2, 8, 24, 16}), k = at::randn({2, 2, 24, 16}), v = at::randn({2, 2, 24, 16});
  EXPECT_EQ(at::_fused_sdp_choice(q, k, v, {}, 0.0, true, std::nullopt, true), 0);  // math
  expect_same("attention math backend", [](const auto& in) { return nn::causal_attention(in[0], in[1], in[2]); },
              [](const auto& in) { return plain_attention(in[0], in[1], in[2]); }, {q, k, v}, false, 1e-5);
  at::globalContext().setSDPUseFlash(true);
}

TEST(LeanLayers, SwiGluEqualsSiluTimesThroughAutograd) {
  at::manual_seed(0);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    at::Tensor h1 = randn({2, 16, 96}, dt) * 3, h3 = randn({2, 16, 96}, dt);
    // The backward runs ATen's own mul and silu_backward kernels on the same operands: bitwise.
    expect_same(std::string("swiglu ") + at::toString(dt), [](const auto& in) { return nn::swiglu(in[0], in[1]); },
                [](const auto& in) { return plain_swiglu(in[0], in[1]); }, {h1, h3}, true, 0.0);
  }
}

// A whole block (grouped-query attention, RoPE, both norms, SwiGLU) against the plain block: input
// and every parameter gradient. fp32: 1e-5; bf16 parameters: 2e-2 (the grouped K/V gradient sums and
// the norms' fp32 rounding each move a bf16 rounding, and the block chains several); bf16 autocast:
// the forward is bitwise the plain one (the norm returns what the matmuls' casts would), gradients
// 2e-2 (the norm's three consumers' gradients now add in bf16, before the norm's backward).
TEST(LeanLayers, BlockEqualsThePlainBlock) {
  at::manual_seed(0);
  for (const std::string mode : {"fp32", "bf16", "bf16 autocast"}) {
    const at::ScalarType dt = mode == "bf16" ? at::kBFloat16 : at::kFloat;
    llama3::TransformerBlock block = make_block(dt);
    at::Tensor cis = rope_table(64, block->attention->head_dim);
    at::Tensor x = (at::randn({2, 64, 256}) * 0.5).to(dt);
    std::vector<at::Tensor> params = block->parameters();
    auto grads = [&](bool lean) {
      for (auto& p : params) p.mutable_grad().reset();
      at::Tensor xi = x.clone().requires_grad_(true);
      at::Tensor out;
      {
        std::optional<CpuBf16Autocast> autocast;
        if (mode == "bf16 autocast") autocast.emplace();
        out = lean ? block->forward(xi, cis) : plain_block(block, xi, cis);
      }
      out.backward(at::ones_like(out) * 0.01);
      std::vector<at::Tensor> g = {out.detach(), xi.grad()};
      for (auto& p : params) g.push_back(p.grad().clone());
      return g;
    };
    auto lean = grads(true), plain = grads(false);
    const double tol = mode == "fp32" ? 1e-5 : 2e-2;
    EXPECT_TRUE(mode == "bf16" || at::equal(lean[0], plain[0])) << mode << ": output differs by "
                                                                 << test::relative_error(lean[0], plain[0]);
    EXPECT_LE(test::relative_error(lean[0], plain[0]), tol) << mode;
    double worst = 0;
    for (size_t i = 1; i < lean.size(); ++i) {
      const double err = test::relative_error(lean[i], plain[i]);
      worst = std::max(worst, err);
      EXPECT_LE(err, tol) << mode << " gradient " << i;
    }
    std::printf("[block %s] output relative error %.2e, worst gradient relative error %.2e\n", mode.c_str(),
                test::relative_error(lean[0], plain[0]), worst);
  }
}

// ---------------------------------------------------------------------------------------------
// Memory: saved-for-backward bytes and peaks, lean vs plain, measured.

void report(const char* what, const test::GraphMemory& lean, const test::GraphMemory& plain) {
  std::printf("[%s] saved for backward: lean %lld B, plain %lld B (%.2f); peak forward+backward: lean %lld B, "
              "plain %lld B (%.2f)\n",
              what, static_cast<long long>(lean.saved), static_cast<long long>(plain.saved),
              static_cast<double>(lean.saved) / static_cast<double>(plain.saved), static_cast<long long>(lean.peak),
              static_cast<long long>(plain.peak), static_cast<double>(lean.peak) / static_cast<double>(plain.peak));
}

// Plain bf16: an fp32 copy of x (for x^2) and the fp32 x * rstd (for the weight's gradient), 4x the
// bf16 input. Lean: x itself and one fp32 number per row.
TEST(LayerMemory, RmsNormSavesItsBf16InputNotFp32Copies) {
  at::Tensor x = randn({4, 64, 256}, at::kBFloat16).requires_grad_(true);
  at::Tensor w = at::ones({256}, at::kBFloat16).requires_grad_(true);
  auto lean = test::measure_graph([&](const auto& in) { return nn::rms_norm(in[0], w, 1e-5); }, {x}, {w});
  auto plain = test::measure_graph([&](const auto& in) { return plain_rms_norm(in[0], w, 1e-5); }, {x}, {w});
  report("rms_norm bf16", lean, plain);
  EXPECT_LE(lean.saved, plain.saved * 3 / 10);
  EXPECT_LT(lean.peak, plain.peak);
}

// Both formulations save only the table (already alive): nothing. The lean one rotates one fp32 copy
// in place, where the plain one holds the fp32 copy and the fp32 product at once, in forward and
// backward: one fp32 tensor less at the peak, of ~6 bf16-sized tensors alive there (input, output,
// gradients and the measurement's own).
TEST(LayerMemory, RopeSavesNothingAndPeaksLower) {
  at::Tensor cis = rope_table(128, 64);
  at::Tensor x = randn({2, 128, 8, 64}, at::kBFloat16).requires_grad_(true);
  auto lean = test::measure_graph([&](const auto& in) { return nn::apply_rope(in[0], cis); }, {x});
  auto plain = test::measure_graph([&](const auto& in) { return plain_rope(in[0], cis); }, {x});
  report("rope bf16", lean, plain);
  EXPECT_EQ(lean.saved, 0);
  EXPECT_LE(lean.peak, plain.peak * 85 / 100);
}

// 8 query heads over 2 key/value heads: the plain form saves q and K/V repeated to 8 heads (24 head-
// sized tensors), the lean one q, k, v (12).
TEST(LayerMemory, GroupedQueryAttentionSavesKeyValueHeadsOnce) {
  at::Tensor q = at::randn({2, 8, 128, 32}).requires_grad_(true);
  at::Tensor k = at::randn({2, 2, 128, 32}).requires_grad_(true), v = at::randn({2, 2, 128, 32}).requires_grad_(true);
  auto lean = test::measure_graph([](const auto& in) { return nn::causal_attention(in[0], in[1], in[2]); }, {q, k, v});
  auto plain = test::measure_graph([](const auto& in) { return plain_attention(in[0], in[1], in[2]); }, {q, k, v});
  report("attention fp32, 8 heads over 2", lean, plain);
  EXPECT_LE(lean.saved, plain.saved * 6 / 10);
  EXPECT_LT(lean.peak, plain.peak);
}

// Plain: h1, silu(h1), h3. Lean: h1, h3.
TEST(LayerMemory, SwiGluSavesTwoHiddenTensorsNotThree) {
  at::Tensor h1 = randn({2, 64, 512}, at::kBFloat16).requires_grad_(true);
  at::Tensor h3 = randn({2, 64, 512}, at::kBFloat16).requires_grad_(true);
  auto lean = test::measure_graph([](const auto& in) { return nn::swiglu(in[0], in[1]); }, {h1, h3});
  auto plain = test::measure_graph([](const auto& in) { return plain_swiglu(in[0], in[1]); }, {h1, h3});
  report("swiglu bf16", lean, plain);
  EXPECT_LE(lean.saved, plain.saved * 7 / 10);
}

// A whole block in bf16 saves half of what it saves in fp32 (the same tensors, half the bytes) up to
// the fp32 statistics both keep (reciprocal RMS per row, attention log-sum-exp per row and head): no
// fp32 copy of a bf16 activation is saved anywhere in it.
TEST(LayerMemory, Bf16BlockSavesNoFp32CopiesOfActivations) {
  auto block_saved = [&](at::ScalarType dt) {
    llama3::TransformerBlock block = make_block(dt);
    at::Tensor cis = rope_table(64, block->attention->head_dim);
    at::Tensor x = randn({2, 64, 256}, dt).requires_grad_(true);
    return test::measure_graph([&](const auto& in) { return block->forward(in[0], cis); }, {x}, block->parameters());
  };
  auto fp32 = block_saved(at::kFloat), bf16 = block_saved(at::kBFloat16);
  std::printf("[block dim 256] saved for backward: fp32 %lld B, bf16 %lld B (%.3f)\n",
              static_cast<long long>(fp32.saved), static_cast<long long>(bf16.saved),
              static_cast<double>(bf16.saved) / static_cast<double>(fp32.saved));
  EXPECT_LE(bf16.saved, fp32.saved * 53 / 100);
}

// Under bf16 autocast the residual stream is fp32. Plain: the norm saves x and the fp32 x * rstd, and
// each of the three matmuls after it saves its own bf16 cast of the norm's fp32 output. Lean: the
// norm saves x, and its bf16 output is the one tensor the three matmuls save.
TEST(LayerMemory, UnderAutocastTheNormOutputIsSavedOnceByTheMatmulsAfterIt) {
  at::Tensor x = at::randn({2, 256, 256}).requires_grad_(true);
  at::Tensor w = at::ones({256}).requires_grad_(true);
  std::vector<at::Tensor> proj = {at::randn({32, 256}).requires_grad_(true), at::randn({32, 256}).requires_grad_(true),
                                  at::randn({32, 256}).requires_grad_(true)};
  auto measure = [&](bool lean) {
    return test::measure_graph(
        [&](const auto& in) {
          CpuBf16Autocast autocast;
          at::Tensor xn = lean ? nn::rms_norm(in[0], w, 1e-5) : plain_rms_norm(in[0], w, 1e-5);
          return at::cat({at::linear(xn, proj[0]), at::linear(xn, proj[1]), at::linear(xn, proj[2])}, -1);
        },
        {x}, {w, proj[0], proj[1], proj[2]});
  };
  auto lean = measure(true), plain = measure(false);
  report("rms_norm + 3 matmuls under bf16 autocast", lean, plain);
  EXPECT_LE(lean.saved, plain.saved * 55 / 100);
}

}  // namespace
}  // namespace titan
