// Parameter initialization: the Philox generator against its published answers, the distributions
// against their analytic moments and CDFs, and the layout independence the design rests on (a slice
// generated alone equals the same slice of the whole, whatever the threads and the vector code path).
#include "models/tiny_llama.h"

#include "titan/common/error.h"
#include "titan/nn/init.h"
#include "titan/nn/init_math.h"
#include "titan/models/llama3/model.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace titan {
namespace {

// Restores the thread count and the kernel variant a test changes.
struct Restore {
  int threads = at::get_num_threads();
  ~Restore() {
    at::set_num_threads(threads);
    init::detail::set_kernel_variant(init::detail::kernel_variants().front());
  }
};

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         std::memcmp(a.contiguous().data_ptr(), b.contiguous().data_ptr(), a.nbytes()) == 0;
}

// ---- the generator

TEST(InitPhilox, MatchesThePublishedKnownAnswers) {
  // Random123's kat_vectors for philox4x32-10: (counter, key) -> output.
  using init::detail::philox4x32_10;
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}),
            (std::array<uint32_t, 4>{0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}));
  EXPECT_EQ(philox4x32_10({0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff}),
            (std::array<uint32_t, 4>{0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}));
  EXPECT_EQ(philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0}),
            (std::array<uint32_t, 4>{0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}));
}

TEST(InitPhilox, EveryVectorCodePathDrawsTheReferenceWords) {
  // Element 64 g + 16 l + j takes word l of the block with counter (16 g + j, attempt, 0). A first
  // element past 2^36 puts bits in the block index's high word.
  Restore restore;
  const auto key = init::detail::philox_key(9, "layers.0.attention.wq.weight");
  const int64_t first = (int64_t{1} << 40) + 37, n = 1000;
  for (const auto& variant : init::detail::kernel_variants()) {
    init::detail::set_kernel_variant(variant);
    for (uint32_t attempt : {0u, 3u}) {
      auto words = init::detail::random_words(9, "layers.0.attention.wq.weight", first, n, attempt);
      for (int64_t i = 0; i < n; i += 7) {
        const int64_t e = first + i, group = e / 64, lane = e % 64 / 16, block = 16 * group + e % 16;
        const auto ref = init::detail::philox4x32_10(
            {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), attempt, 0}, key);
        ASSERT_EQ(words[i], ref[lane]) << variant << " element " << e << " attempt " << attempt;
      }
    }
  }
}

// The one-element functions the CUDA kernel runs (init_math.h), on the host: every element's bits equal
// the CPU kernel's, for every vector code path, normal and truncated (with rejections: cut-offs at
// +-1 std reject a third of the first draws), at an offset past 2^36 elements.
TEST(InitPhilox, OneElementAtATimeEqualsEveryVectorCodePathBitwise) {
  Restore restore;
  const auto key = init::detail::philox_key(9, "output.weight");
  const int64_t first = (int64_t{1} << 37) + 29, n = 20000;
  for (const auto& variant : init::detail::kernel_variants()) {
    init::detail::set_kernel_variant(variant);
    at::Tensor normal = at::empty({n}), truncated = at::empty({n});
    init::normal(normal, 9, "output.weight", first, 0.25, 0.02);
    init::trunc_normal(truncated, 9, "output.weight", first, 0.0, 0.5, -0.5, 0.5);
    const float* nv = normal.data_ptr<float>();
    const float* tv = truncated.data_ptr<float>();
    int rejected = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float want_n = init::math::normal_at(first + i, 0, key[0], key[1], 0.25f, 0.02f);
      ASSERT_EQ(init::math::bits_of(nv[i]), init::math::bits_of(want_n)) << variant << " normal, element " << first + i;
      const float want_t = init::math::truncated_at(first + i, key[0], key[1], 0.0f, 0.5f, -0.5f, 0.5f);
      ASSERT_EQ(init::math::bits_of(tv[i]), init::math::bits_of(want_t)) << variant << " truncated, element " << first + i;
      const float first_draw = init::math::normal_at(first + i, 0, key[0], key[1], 0.0f, 0.5f);
      rejected += first_draw < -0.5f || first_draw > 0.5f;
    }
    EXPECT_GT(rejected, n / 5) << "the truncated case redraws";
  }
}

// ---- distributions

struct Moments {
  double mean, var, skew, kurt, m4;  // kurt: excess kurtosis; m4: 4th central moment
};

Moments moments(const at::Tensor& t) {
  const at::Tensor x = t.to(at::kDouble).flatten();
  const double mean = x.mean().item<double>();
  const at::Tensor c = x - mean;
  const double var = c.pow(2).mean().item<double>(), m3 = c.pow(3).mean().item<double>();
  const double m4 = c.pow(4).mean().item<double>();
  return {mean, var, m3 / std::pow(var, 1.5), m4 / (var * var) - 3, m4};
}

double phi(double z) { return std::exp(-z * z / 2) / std::sqrt(2 * M_PI); }
double Phi(double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); }

constexpr int64_t kSamples = int64_t{1} << 20;

TEST(InitNormal, HasTheMomentsAndTailsOfANormal) {
  // Tolerances: 5 standard errors of each statistic for 2^20 samples (a false alarm ~1 in 10^6).
  at::Tensor x = at::empty({kSamples});
  init::normal(x, 3, "w", 0, 0.5, 2.0);
  const Moments m = moments(x);
  const double n = static_cast<double>(kSamples);
  EXPECT_NEAR(m.mean, 0.5, 5 * 2.0 / std::sqrt(n));
  EXPECT_NEAR(m.var, 4.0, 5 * std::sqrt(2.0 / n) * 4.0);
  EXPECT_NEAR(m.skew, 0.0, 5 * std::sqrt(6.0 / n));
  EXPECT_NEAR(m.kurt, 0.0, 5 * std::sqrt(24.0 / n));
  // Tails: the fractions beyond 2, 3 and 4 std (the generator reaches 6.77 std).
  const at::Tensor z = ((x - 0.5) / 2.0).abs();
  for (double k : {2.0, 3.0, 4.0}) {
    const double p = 2 * Phi(-k), frac = (z > k).to(at::kDouble).mean().item<double>();
    EXPECT_NEAR(frac, p, 5 * std::sqrt(p * (1 - p) / n)) << "beyond " << k << " std";
  }
  EXPECT_LT(z.max().item<double>(), 6.8);
}

struct TruncCase {
  const char* what;
  double mean, std, a, b;
};

TEST(InitTruncNormal, HasTheTruncatedMomentsAndCdfAndStaysInside) {
  const std::vector<TruncCase> cases = {
      {"+-1 std (rejection, 68% kept)", 0.0, 1.0, -1.0, 1.0},
      {"[-0.5, 2] std (rejection, asymmetric)", 0.3, 2.0, 0.3 - 1.0, 0.3 + 4.0},
      {"+-3 std (the output layer's)", 0.0, 0.0625, -0.1875, 0.1875},
      {"+-2 absolute, std 0.02 (never binds)", 0.0, 0.02, -2.0, 2.0},
      {"[2, 3] std (inverse CDF, 2% kept)", 0.0, 1.0, 2.0, 3.0},
      {"[-0.05, 0.05] std (inverse CDF, around the mean)", 1.0, 1.0, 0.95, 1.05},
      {"[-5, -4] std (inverse CDF, far tail)", 0.0, 0.5, -2.5, -2.0},
  };
  const double n = static_cast<double>(kSamples);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    at::Tensor x = at::empty({kSamples});
    init::trunc_normal(x, 11, "t", 0, c.mean, c.std, c.a, c.b);
    // Hard bounds.
    EXPECT_GE(x.min().item<double>(), c.a);
    EXPECT_LE(x.max().item<double>(), c.b);
    // Analytic moments of the truncated normal; 5 standard errors.
    const double al = (c.a - c.mean) / c.std, be = (c.b - c.mean) / c.std, Z = Phi(be) - Phi(al);
    const double d = (phi(al) - phi(be)) / Z;
    const double mean = c.mean + c.std * d;
    const double var = c.std * c.std * (1 + (al * phi(al) - be * phi(be)) / Z - d * d);
    const Moments m = moments(x);
    EXPECT_NEAR(m.mean, mean, 5 * std::sqrt(var / n) + 1e-7 * std::abs(mean));
    EXPECT_NEAR(m.var, var, 5 * std::sqrt((m.m4 - m.var * m.var) / n));
    // Shape: Kolmogorov-Smirnov distance to the truncated CDF on a grid (critical value at 1e-6:
    // 2.7 / sqrt(n)).
    at::Tensor sorted = std::get<0>(x.to(at::kDouble).sort());
    const double* s = sorted.data_ptr<double>();
    double ks = 0;
    const double lo = std::max(c.a, c.mean - 6 * c.std), hi = std::min(c.b, c.mean + 6 * c.std);
    for (int i = 1; i < 400; ++i) {
      const double v = lo + (hi - lo) * i / 400;
      const double F = (Phi((v - c.mean) / c.std) - Phi(al)) / Z;
      const double Fn = static_cast<double>(std::upper_bound(s, s + kSamples, v) - s) / n;
      ks = std::max(ks, std::abs(F - Fn));
    }
    EXPECT_LT(ks, 2.7 / std::sqrt(n));
  }
}

// ---- layout independence

using Gen = std::function<void(at::Tensor out, int64_t first)>;

std::vector<std::pair<std::string, Gen>> generators() {
  return {
      {"normal", [](at::Tensor o, int64_t f) { init::normal(o, 5, "p", f, 0.0, 1.0); }},
      {"trunc_normal +-1 std (rejection)", [](at::Tensor o, int64_t f) { init::trunc_normal(o, 5, "p", f, 0.0, 1.0, -1.0, 1.0); }},
      {"trunc_normal [-0.5, 2] std", [](at::Tensor o, int64_t f) { init::trunc_normal(o, 5, "p", f, 0.0, 0.1, -0.05, 0.2); }},
      {"trunc_normal [2, 3] std (inverse CDF)", [](at::Tensor o, int64_t f) { init::trunc_normal(o, 5, "p", f, 0.0, 1.0, 2.0, 3.0); }},
  };
}

TEST(InitSlices, ASliceAloneEqualsTheSameSliceOfTheWholeBitwise) {
  // Odd offsets and lengths, inside one group of 64, across groups, across the chunks threads take.
  Restore restore;
  const int64_t n = (int64_t{1} << 20) + 12345;
  const std::vector<std::pair<int64_t, int64_t>> slices = {
      {0, 1}, {1, 63}, {63, 2}, {64, 64}, {65, 1000}, {12345, 543210}, {131071, 131075}, {n - 7, 7}, {3, n - 3}};
  const int many = std::max(4, restore.threads);
  for (const auto& [what, gen] : generators()) {
    SCOPED_TRACE(what);
    at::set_num_threads(many);
    at::Tensor whole = at::empty({n});
    gen(whole, 0);
    for (int threads : {1, many}) {
      at::set_num_threads(threads);
      for (const auto& [first, len] : slices) {
        at::Tensor alone = at::empty({len});
        gen(alone, first);
        EXPECT_TRUE(same_bits(alone, whole.slice(0, first, first + len)))
            << "slice [" << first << ", " << first + len << ") with " << threads << " threads";
      }
    }
  }
}

TEST(InitSlices, EveryVectorCodePathGivesTheSameBits) {
  Restore restore;
  const auto variants = init::detail::kernel_variants();
  ASSERT_EQ(variants.back(), "generic");
  for (const auto& [what, gen] : generators()) {
    SCOPED_TRACE(what);
    at::Tensor reference;
    for (const auto& v : variants) {
      init::detail::set_kernel_variant(v);
      at::Tensor x = at::empty({100003});
      gen(x, 77);
      if (!reference.defined()) reference = x;
      EXPECT_TRUE(same_bits(x, reference)) << v << " vs " << variants.front();
    }
  }
}

TEST(InitSlices, NamesAndSeedsDrawIndependentValues) {
  const int64_t n = 1 << 16;
  auto draw = [&](uint64_t seed, const char* name) {
    at::Tensor x = at::empty({n});
    init::normal(x, seed, name, 0, 0.0, 1.0);
    return x.to(at::kDouble);
  };
  const at::Tensor base = draw(1, "layers.0.attention.wq.weight");
  for (const at::Tensor& other : {draw(2, "layers.0.attention.wq.weight"), draw(1, "layers.1.attention.wq.weight"),
                                  draw(1, "layers.0.attention.wk.weight")}) {
    EXPECT_FALSE(at::equal(base, other));
    // Uncorrelated: |r| within 5 standard errors (1 / sqrt(n)) of 0.
    const double r = (base * other).mean().item<double>() / (base.std().item<double>() * other.std().item<double>());
    EXPECT_LT(std::abs(r), 5 / std::sqrt(static_cast<double>(n)));
  }
}

// Elements [1000, 1000 + 37 * 11) of a truncated normal, as a (37, 11) fp32 CPU tensor.
at::Tensor expected_37x11() {
  at::Tensor expected = at::empty({37 * 11});
  init::trunc_normal(expected, 2, "x", 1000, 0.0, 0.5, -1.0, 1.0);
  return expected.view({37, 11});
}

TEST(InitSlices, AnyDtypeAndLayoutHoldsTheFp32ValuesOfItsElements) {
  const at::Tensor expected = expected_37x11();
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kDouble}) {  // rounded like Tensor::to
    at::Tensor t = at::empty({37, 11}, dtype);
    init::trunc_normal(t, 2, "x", 1000, 0.0, 0.5, -1.0, 1.0);
    EXPECT_TRUE(at::equal(t, expected.to(dtype))) << dtype;
  }
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor transposed = at::empty({11, 37}, dtype).t();  // not contiguous: elements in logical order
    init::trunc_normal(transposed, 2, "x", 1000, 0.0, 0.5, -1.0, 1.0);
    EXPECT_TRUE(at::equal(transposed, expected.to(dtype))) << dtype;
  }
  at::Tensor param = at::empty({37, 11}).requires_grad_();  // a leaf that requires grad
  init::trunc_normal(param, 2, "x", 1000, 0.0, 0.5, -1.0, 1.0);
  EXPECT_TRUE(at::equal(param.detach(), expected));
  init::ones(param);
  EXPECT_TRUE(at::equal(param.detach(), at::ones({37, 11})));
}

TEST(InitSlices, CudaTensorsHoldTheValuesOfCpuOnes) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const at::Tensor expected = expected_37x11();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor cuda = at::empty({37, 11}, at::TensorOptions().device(at::kCUDA).dtype(dtype));
    init::trunc_normal(cuda, 2, "x", 1000, 0.0, 0.5, -1.0, 1.0);
    EXPECT_TRUE(at::equal(cuda.cpu(), expected.to(dtype))) << dtype;
  }
}

// Normal and truncated (rejection) values of a CUDA tensor come from the GPU kernel (init_math.h), every
// bit the CPU's: 9.6M elements at an offset past 2^36, in fp32, bf16, fp16 and a non-contiguous view,
// cut-offs at +-1 std (a third of the first draws redrawn), compared bit for bit (+0 and -0 apart).
TEST(InitSlices, LargeCudaTensorsHoldTheValuesOfCpuOnes) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const int64_t rows = 2333, cols = 4099, first = (int64_t{1} << 37) + 29;
  at::Tensor normal = at::empty({rows, cols}, at::kFloat), truncated = at::empty({rows, cols}, at::kFloat);
  init::normal(normal, 9, "big", first, 0.25, 0.02);
  init::trunc_normal(truncated, 9, "big", first, 0.0, 0.5, -0.5, 0.5);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    at::Tensor cuda = at::empty({rows, cols}, at::TensorOptions().device(at::kCUDA).dtype(dtype));
    init::normal(cuda, 9, "big", first, 0.25, 0.02);
    EXPECT_TRUE(same_bits(cuda.cpu(), normal.to(dtype))) << "normal " << dtype;
    init::trunc_normal(cuda, 9, "big", first, 0.0, 0.5, -0.5, 0.5);
    EXPECT_TRUE(same_bits(cuda.cpu(), truncated.to(dtype))) << "truncated " << dtype;
  }
  at::Tensor storage = at::empty({cols, rows}, at::TensorOptions().device(at::kCUDA));
  at::Tensor transposed = storage.t();  // (rows, cols), not contiguous
  init::normal(transposed, 9, "big", first, 0.25, 0.02);
  EXPECT_TRUE(same_bits(transposed.contiguous().cpu(), normal));
}

// What the GPU kernel does not draw (narrow cut-offs: the inverse CDF) is generated on the CPU and
// copied through two pinned buffers that alternate, each chunk's copy overlapping the next chunk's
// generation: every one of three 16 MB chunks lands where the CPU's values are, in fp32 and bf16.
TEST(InitSlices, LargeCudaTensorsDrawnOnTheCpuArriveWhole) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const int64_t rows = 2333, cols = 4099;  // 9.6M elements: three chunks, the last one partial
  at::Tensor cpu = at::empty({rows, cols}, at::kFloat);
  init::trunc_normal(cpu, 9, "big", 77, 0.0, 0.02, 0.05, 0.06);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    at::Tensor cuda = at::empty({rows, cols}, at::TensorOptions().device(at::kCUDA).dtype(dtype));
    init::trunc_normal(cuda, 9, "big", 77, 0.0, 0.02, 0.05, 0.06);
    EXPECT_TRUE(same_bits(cuda.cpu(), cpu.to(dtype))) << dtype;
  }
}

// ---- the model's rows

TEST(InitLlama3, InitRowsOfARowRangeEqualsThoseRowsOfInitWeights) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied embeddings" : "separate output layer");
    llama3::ModelArgs args = test::tiny_llama(2, 1001, 32);
    args.tie_embeddings = tied;
    llama3::Transformer m(args, at::TensorOptions());
    m->init_weights(5);
    for (const auto& p : m->named_parameters()) {
      const int64_t rows = p.value().size(0);
      for (auto [first, len] : std::vector<std::pair<int64_t, int64_t>>{
               {0, rows}, {1, std::min<int64_t>(3, rows - 1)}, {rows / 3, rows / 3 + 1}, {rows - 1, 1}}) {
        std::vector<int64_t> shape = p.value().sizes().vec();
        shape[0] = len;
        at::Tensor fp32 = at::empty(shape), bf16 = at::empty(shape, at::kBFloat16);
        m->init_rows(5, p.key(), fp32, first);
        m->init_rows(5, p.key(), bf16, first);
        const at::Tensor want = p.value().detach().slice(0, first, first + len);
        EXPECT_TRUE(same_bits(fp32, want)) << p.key() << " rows [" << first << ", " << first + len << ")";
        EXPECT_TRUE(at::equal(bf16, want.to(at::kBFloat16))) << p.key();
      }
    }
    EXPECT_THROW(m->init_rows(5, "layers.9.attention.wq.weight", at::empty({1, 64}), 0), InternalError);
    EXPECT_THROW(m->init_rows(5, "norm.weight", at::empty({2}), 63), InternalError);  // past the end
  }
}

}  // namespace
}  // namespace titan
