// titan's fused CUDA kernels (titan/nn/fused_kernels.h) and their arithmetic (titan/nn/fused_math.h).
//
// FusedMath (every machine): the per-element functions the kernels apply, against ATen's
// formulations in float64 (tolerances a few fp32 roundings: 1e-6 relative to the tensor's scale).
//
// CudaFusedKernels (a GPU machine; skipped elsewhere): each kernel against float64 computed on the CPU
// from the same rounded inputs, in float32, bfloat16 and float16, on the 16-byte path and the one
// element at a time (odd sizes, offset views), and non-contiguous inputs. Tolerances: fp32 1e-5 of
// the tensor's scale (float32 arithmetic, expf); bf16 and fp16 outputs are rounded once from fp32, so
// each element is within half a unit in the last place of the exact value plus the fp32 error:
// 2^-8 (bf16) and 2^-11 (fp16) relative to the element, plus 1e-6 of the scale. Cross-entropy
// gradients: elements of order 1/V, checked against the tensor's scale at the same bounds. Also
// RMSNorm in bf16 through ATen's fused kernels without fp32 copies (values and measured memory).
#include "titan/nn/fused_kernels.h"
#include "titan/nn/fused_math.h"
#include "titan/nn/layers.h"
#include "titan/nn/loss.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/autograd.h>
#include <torch/cuda.h>
#if __has_include(<c10/cuda/CUDACachingAllocator.h>) && __has_include(<cuda_runtime_api.h>)
#define TITAN_TEST_HAS_CUDA_ALLOCATOR 1
#include <c10/cuda/CUDACachingAllocator.h>
#else
#define TITAN_TEST_HAS_CUDA_ALLOCATOR 0
#endif

#include <cmath>
#include <vector>

namespace titan {
namespace {

namespace fm = nn::fused_math;

double scale_error(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.to(at::kCPU, at::kDouble), w = want.to(at::kCPU, at::kDouble);
  return (g - w).abs().max().item<double>() / std::max(w.abs().max().item<double>(), 1e-30);
}

// Every element of got within rel * |want| + abs_of_scale * max|want| of want; returns the worst
// ratio of error to bound (<= 1 passes).
double bounded_error(const at::Tensor& got, const at::Tensor& want, double rel, double abs_of_scale) {
  const at::Tensor g = got.to(at::kCPU, at::kDouble), w = want.to(at::kCPU, at::kDouble);
  const double scale = std::max(w.abs().max().item<double>(), 1e-30);
  return ((g - w).abs() / (w.abs() * rel + abs_of_scale * scale)).max().item<double>();
}

TEST(FusedMath, SwigluAndItsGradientsEqualAtensSiluTimesB) {
  at::manual_seed(1);
  at::Tensor a = at::cat({at::randn({4000}) * 3, at::tensor({-88.f, -30.f, -1e-3f, 0.f, 1e-3f, 30.f, 88.f})});
  at::Tensor b = at::randn({a.numel()}), g = at::randn({a.numel()});
  at::Tensor ad = a.to(at::kDouble).requires_grad_(true), bd = b.to(at::kDouble).requires_grad_(true);
  at::Tensor out = at::silu(ad) * bd;
  out.backward(g.to(at::kDouble));
  at::Tensor y = at::empty_like(a), da = at::empty_like(a), db = at::empty_like(a);
  for (int64_t i = 0; i < a.numel(); ++i) {
    const float ai = a[i].item<float>(), bi = b[i].item<float>(), gi = g[i].item<float>();
    y[i] = fm::swiglu(ai, bi);
    const fm::SwigluGrads d = fm::swiglu_backward(gi, ai, bi);
    da[i] = d.da;
    db[i] = d.db;
  }
  EXPECT_LT(scale_error(y, out.detach()), 1e-6);
  EXPECT_LT(scale_error(da, ad.grad()), 1e-6);
  EXPECT_LT(scale_error(db, bd.grad()), 1e-6);
}

TEST(FusedMath, RotateIsTheComplexProductAndItsConjugateUndoesIt) {
  at::manual_seed(2);
  at::Tensor x = at::randn({500, 2}), angle = at::rand({500}) * 6.3;
  at::Tensor cis = at::polar(at::ones_like(angle), angle);
  at::Tensor want = at::view_as_real(at::view_as_complex(x.to(at::kDouble)) * cis.to(at::kComplexDouble));
  at::Tensor got = at::empty_like(x), back = at::empty_like(x);
  for (int64_t i = 0; i < 500; ++i) {
    const float c = std::cos(angle[i].item<float>()), s = std::sin(angle[i].item<float>());
    const fm::Pair r = fm::rotate(x[i][0].item<float>(), x[i][1].item<float>(), c, s);
    got[i][0] = r.re;
    got[i][1] = r.im;
    const fm::Pair u = fm::rotate(r.re, r.im, c, -s);
    back[i][0] = u.re;
    back[i][1] = u.im;
  }
  EXPECT_LT(scale_error(got, want), 1e-6);
  EXPECT_LT(scale_error(back, x), 1e-6);
}

// A row's log-sum-exp accumulated one value at a time by 37 "threads" (a stride of 37), then merged
// in a tree as the kernel's warp and block reductions do, against at::logsumexp in float64; with
// -inf entries, a row of only -inf (-inf), a NaN (NaN) and empty accumulators merged.
TEST(FusedMath, RunningLogSumExpInAnyOrderEqualsAtensLogsumexp) {
  at::manual_seed(3);
  auto lse_of = [](const at::Tensor& row) {
    std::vector<fm::MaxSum> part(37);
    for (int64_t j = 0; j < row.numel(); ++j) part[j % 37] = fm::lse_add(part[j % 37], row[j].item<float>());
    while (part.size() > 1) {
      std::vector<fm::MaxSum> next;
      for (size_t i = 0; i < part.size(); i += 2) next.push_back(i + 1 < part.size() ? fm::lse_merge(part[i], part[i + 1]) : part[i]);
      part = next;
    }
    return fm::lse_value(part[0]);
  };
  for (int trial = 0; trial < 4; ++trial) {
    at::Tensor row = at::randn({1000}) * (trial * 10 + 1) + trial * 50;
    if (trial == 3) row.slice(0, 0, 1000, 3).fill_(-INFINITY);
    const double want = at::logsumexp(row.to(at::kDouble), 0).item<double>();
    EXPECT_NEAR(lse_of(row), want, 1e-6 * std::max(1.0, std::abs(want))) << "trial " << trial;
  }
  EXPECT_EQ(lse_of(at::full({100}, -INFINITY)), -INFINITY);
  at::Tensor with_nan = at::randn({100});
  with_nan[57] = NAN;
  EXPECT_TRUE(std::isnan(lse_of(with_nan)));
  with_nan.slice(0, 0, 57).fill_(-INFINITY);  // the NaN alone in its part (57 and 94: the 21st of 37), whose max stays -inf
  with_nan[94] = -INFINITY;
  EXPECT_TRUE(std::isnan(lse_of(with_nan)));
  const fm::MaxSum one = fm::lse_add({}, 2.0f);
  EXPECT_EQ(fm::lse_value(fm::lse_merge({}, one)), 2.0f);
  EXPECT_EQ(fm::lse_value(fm::lse_merge(one, {})), 2.0f);
}

TEST(FusedMath, CrossEntropyGradientEqualsAtens) {
  at::manual_seed(4);
  at::Tensor x = at::randn({300}) * 5;
  const int64_t y = 123;
  const float g = 0.37f;
  at::Tensor xd = x.to(at::kDouble).unsqueeze(0).requires_grad_(true);
  (at::cross_entropy_loss(xd, at::tensor({y}), {}, at::Reduction::Sum) * g).backward();
  const float lse = at::logsumexp(x, 0).item<float>();
  at::Tensor got = at::empty_like(x);
  for (int64_t j = 0; j < 300; ++j) got[j] = fm::ce_grad(x[j].item<float>(), lse, j == y, g);
  EXPECT_LT(scale_error(got, xd.grad().squeeze(0)), 1e-6);
}

#define SKIP_WITHOUT_A_GPU() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible: this check runs only on a GPU machine"

struct Dtype {
  at::ScalarType type;
  const char* name;
  double rel;  // half a unit in the last place, relative
};
const Dtype kDtypes[] = {{at::kFloat, "float32", 0}, {at::kBFloat16, "bfloat16", 1.0 / 256}, {at::kHalf, "float16", 1.0 / 2048}};

// fp32: 1e-5 of the scale; bf16/fp16: the rounding of each element plus 1e-6 of the scale.
void expect_close(const at::Tensor& got, const at::Tensor& want, const Dtype& d, const std::string& what) {
  ASSERT_EQ(got.scalar_type(), d.type) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double worst = d.rel == 0 ? scale_error(got, want) / 1e-5 : bounded_error(got, want, d.rel, 1e-6);
  EXPECT_LE(worst, 1.0) << what << " (" << d.name << "): error " << worst << " of its bound";
}

TEST(CudaFusedKernels, SwigluEqualsFloat64OnBothPathsAndViews) {
  SKIP_WITHOUT_A_GPU();
  ASSERT_TRUE(nn::fused::kernels_built());
  at::manual_seed(5);
  for (const Dtype& d : kDtypes) {
    // 16-byte path (4096 elements), element path (an odd count), and views offset by one element.
    for (int64_t n : {int64_t{4096}, int64_t{4099}}) {
      for (int64_t offset : {0, 1}) {
        at::Tensor a_all = (at::randn({n + offset}) * 3).to(d.type).to(at::kCUDA);
        at::Tensor b_all = at::randn({n + offset}).to(d.type).to(at::kCUDA);
        at::Tensor g_all = at::randn({n + offset}).to(d.type).to(at::kCUDA);
        at::Tensor a = a_all.slice(0, offset), b = b_all.slice(0, offset), g = g_all.slice(0, offset);
        ASSERT_TRUE(nn::fused::swiglu_accepts(a, b));
        at::Tensor ad = a.to(at::kCPU, at::kDouble).requires_grad_(true), bd = b.to(at::kCPU, at::kDouble).requires_grad_(true);
        at::Tensor want = at::silu(ad) * bd;
        want.backward(g.to(at::kCPU, at::kDouble));
        const std::string what = "n " + std::to_string(n) + " offset " + std::to_string(offset);
        expect_close(nn::fused::swiglu_forward(a, b), want.detach(), d, "swiglu " + what);
        auto [da, db] = nn::fused::swiglu_backward(g, a, b);
        expect_close(da, ad.grad(), d, "swiglu d/da " + what);
        expect_close(db, bd.grad(), d, "swiglu d/db " + what);
      }
    }
  }
  // Through the layer: the model's swiglu (autograd) takes the fused path on CUDA.
  at::Tensor h1 = at::randn({2, 5, 64}, at::device(at::kCUDA)).requires_grad_(true);
  at::Tensor h3 = at::randn({2, 5, 64}, at::device(at::kCUDA)).requires_grad_(true);
  at::Tensor out = nn::swiglu(h1, h3);
  out.sum().backward();
  at::Tensor h1c = h1.detach().cpu().to(at::kDouble).requires_grad_(true), h3c = h3.detach().cpu().to(at::kDouble).requires_grad_(true);
  (at::silu(h1c) * h3c).sum().backward();
  expect_close(h1.grad(), h1c.grad(), kDtypes[0], "nn::swiglu d/dh1");
  expect_close(h3.grad(), h3c.grad(), kDtypes[0], "nn::swiglu d/dh3");
}

TEST(CudaFusedKernels, RopeEqualsTheComplexProductForViewsAndItsInverse) {
  SKIP_WITHOUT_A_GPU();
  at::manual_seed(6);
  const int64_t B = 2, S = 33, n = 3, E = 16;
  at::Tensor angle = at::rand({S, E / 2}) * 6.3;
  at::Tensor cis = at::polar(at::ones_like(angle), angle);
  for (const Dtype& d : kDtypes) {
    // Contiguous (B, S, n, E), a (B, n, S, E) tensor transposed to (B, S, n, E) (as attention's
    // gradients arrive), and the first E of a wider last dimension (partial rotary dimensions).
    at::Tensor base = at::randn({B, S, n, E}).to(d.type);
    at::Tensor transposed = at::randn({B, n, S, E}).to(d.type).to(at::kCUDA).transpose(1, 2);
    at::Tensor wide = at::randn({B, S, n, E + 8}).to(d.type).to(at::kCUDA).narrow(3, 0, E);
    for (const at::Tensor& x : {base.to(at::kCUDA), transposed, wide}) {
      ASSERT_TRUE(nn::fused::rope_accepts(x, cis.to(at::kCUDA)));
      at::Tensor xd = at::view_as_complex(x.to(at::kCPU, at::kDouble).contiguous().view({B, S, n, E / 2, 2}));
      at::Tensor cd = cis.to(at::kComplexDouble).view({1, S, 1, E / 2});
      expect_close(nn::fused::rope(x, cis.to(at::kCUDA), false), at::view_as_real(xd * cd).reshape({B, S, n, E}), d, "rope");
      expect_close(nn::fused::rope(x, cis.to(at::kCUDA), true), at::view_as_real(xd * cd.conj()).reshape({B, S, n, E}),
                   d, "rope inverse");
    }
  }
  // Through the layer's autograd: apply_rope forward and backward (the inverse rotation).
  at::Tensor x = at::randn({B, S, n, E}, at::device(at::kCUDA)).requires_grad_(true);
  at::Tensor g = at::randn({B, S, n, E});
  nn::apply_rope(x, cis.to(at::kCUDA)).backward(g.to(at::kCUDA));
  at::Tensor xc = x.detach().cpu().to(at::kDouble).requires_grad_(true);
  at::Tensor rotated = at::view_as_real(at::view_as_complex(xc.view({B, S, n, E / 2, 2})) *
                                        cis.to(at::kComplexDouble).view({1, S, 1, E / 2}));
  rotated.reshape({B, S, n, E}).backward(g.to(at::kDouble));
  expect_close(x.grad(), xc.grad(), kDtypes[0], "apply_rope backward");
}

TEST(CudaFusedKernels, CrossEntropyEqualsFloat64WithIgnoredRows) {
  SKIP_WITHOUT_A_GPU();
  at::manual_seed(7);
  // V 1000: whole 16-byte rows; V 1001: one element at a time; V 128256: Llama 3's vocabulary.
  for (int64_t V : {int64_t{1000}, int64_t{1001}, int64_t{128256}}) {
    const int64_t N = V > 10000 ? 6 : 37;
    at::Tensor labels = at::randint(V, {N}, at::kLong);
    labels.slice(0, 0, N, 5).fill_(nn::kIgnoreIndex);
    for (const Dtype& d : kDtypes) {
      at::Tensor logits = (at::randn({N, V}) * 4).to(d.type);
      at::Tensor xd = logits.to(at::kDouble).requires_grad_(true);
      at::Tensor want = at::cross_entropy_loss(xd, labels, {}, at::Reduction::Sum);
      const double g = 0.25;
      (want * g).backward();
      const std::string what = "V " + std::to_string(V);
      at::Tensor x = logits.to(at::kCUDA).requires_grad_(true);
      at::Tensor got = nn::cross_entropy_sum(x, labels.to(at::kCUDA), nn::kLossChunkTokens, nn::LossKernels::kFused);
      (got * g).backward();
      EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-5 * std::abs(want.item<double>())) << what << " " << d.name;
      expect_close(x.grad(), xd.grad(), d, "cross-entropy gradient " + what);
      // Ignored rows: exactly zero gradient.
      EXPECT_TRUE(at::equal(x.grad().cpu().index_select(0, at::arange(0, N, 5)),
                            at::zeros({(N + 4) / 5, V}, d.type)))
          << what;
      // kAuto takes the fused kernels for these CUDA tensors.
      ASSERT_TRUE(nn::fused::cross_entropy_accepts(logits.to(at::kCUDA), labels.to(at::kCUDA)));
      at::Tensor x2 = logits.to(at::kCUDA).requires_grad_(true);
      at::Tensor auto_loss = nn::cross_entropy_sum(x2, labels.to(at::kCUDA));
      (auto_loss * g).backward();
      EXPECT_EQ(auto_loss.item<float>(), got.item<float>()) << what;
      EXPECT_TRUE(at::equal(x2.grad(), x.grad())) << what;
    }
  }
  // Rows of a wider tensor: a row stride above V (16-byte rows), and rows starting one element in
  // (misaligned: one element at a time); forward and backward against float64.
  at::Tensor wide = at::randn({8, 1040}, at::device(at::kCUDA));
  at::Tensor labels = at::randint(1000, {8}, at::device(at::kCUDA).dtype(at::kLong));
  for (int64_t offset : {0, 1}) {
    at::Tensor rows = wide.narrow(1, offset, 1000);
    auto [lse, loss] = nn::fused::cross_entropy_forward(rows, labels, nn::kIgnoreIndex);
    at::Tensor rd = rows.cpu().to(at::kDouble).requires_grad_(true);
    at::Tensor want = at::cross_entropy_loss(rd, labels.cpu(), {}, at::Reduction::Sum);
    want.backward();
    EXPECT_LT(scale_error(lse, at::logsumexp(rd.detach(), 1)), 1e-6) << "offset " << offset;
    EXPECT_NEAR(loss.sum().item<double>(), want.item<double>(), 1e-5 * std::abs(want.item<double>())) << offset;
    at::Tensor grad = nn::fused::cross_entropy_backward(rows, labels, lse, at::ones({}, at::device(at::kCUDA)),
                                                        nn::kIgnoreIndex);
    expect_close(grad, rd.grad(), kDtypes[0], "cross-entropy backward, row stride 1040, offset " + std::to_string(offset));
  }
  // Every row ignored: zero loss, zero gradient.
  at::Tensor all_ignored = at::full({8}, nn::kIgnoreIndex, at::device(at::kCUDA).dtype(at::kLong));
  at::Tensor xi = wide.narrow(1, 0, 1000).detach().requires_grad_(true);
  at::Tensor zero = nn::cross_entropy_sum(xi, all_ignored);
  zero.backward();
  EXPECT_EQ(zero.item<float>(), 0.0f);
  EXPECT_TRUE(at::equal(xi.grad(), at::zeros_like(xi.grad())));
  // A label outside the vocabulary: NaN loss and NaN gradients on its row only.
  labels[3] = 1000;
  at::Tensor xo = wide.narrow(1, 0, 1000).detach().requires_grad_(true);
  at::Tensor bad = nn::cross_entropy_sum(xo, labels);
  bad.backward();
  EXPECT_TRUE(std::isnan(bad.item<float>()));
  EXPECT_TRUE(at::isnan(xo.grad()[3]).all().item<bool>());
  EXPECT_FALSE(at::isnan(xo.grad()[2]).any().item<bool>());
}

// RMSNorm with x, the weight and the output in bf16 (FSDP's mixed precision): ATen's fused kernels
// take them directly. Values against float64 (the output and both gradients rounded once); memory
// measured: the forward pass allocates the bf16 output and the rstd only, where fp32 copies of x and
// y (4x x's bytes more) would show.
TEST(CudaFusedKernels, RmsNormInBf16EqualsFloat64WithoutFp32Copies) {
  SKIP_WITHOUT_A_GPU();
#if !TITAN_TEST_HAS_CUDA_ALLOCATOR
  FAIL() << "a GPU is visible but this build has no CUDA allocator headers";
#else
  at::manual_seed(8);
  const int64_t rows = 4096, D = 2048;
  at::Tensor x = at::randn({rows, D}).to(at::kBFloat16).to(at::kCUDA).requires_grad_(true);
  at::Tensor w = (at::rand({D}) + 0.5).to(at::kBFloat16).to(at::kCUDA).requires_grad_(true);
  at::Tensor g = at::randn({rows, D}).to(at::kBFloat16);
  torch::cuda::synchronize();
  const int64_t before = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  at::Tensor y = nn::rms_norm(x, w, 1e-5);
  torch::cuda::synchronize();
  const int64_t peak = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak - before;
  const int64_t x_bytes = x.numel() * 2;
  EXPECT_LT(peak, x_bytes * 3 / 2) << "forward allocated " << peak << " bytes for a " << x_bytes << "-byte x";
  y.backward(g.to(at::kCUDA));
  at::Tensor xd = x.detach().cpu().to(at::kDouble).requires_grad_(true), wd = w.detach().cpu().to(at::kDouble).requires_grad_(true);
  at::Tensor yd = xd * at::rsqrt(xd.pow(2).mean(-1, true) + 1e-5) * wd;
  yd.backward(g.to(at::kDouble));
  const Dtype& bf16 = kDtypes[1];
  expect_close(y.detach(), yd.detach(), bf16, "rms_norm");
  expect_close(x.grad(), xd.grad(), bf16, "rms_norm d/dx");
  // The weight's gradient sums 4096 rows: fp32 accumulation in another order, then one rounding.
  EXPECT_LE(bounded_error(w.grad(), wd.grad(), bf16.rel, 1e-5), 1.0);
#endif
}

}  // namespace
}  // namespace titan
