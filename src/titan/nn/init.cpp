#include "titan/nn/init.h"

#include "titan/common/error.h"
#include "titan/common/tensor_storage.h"
#include "titan/nn/fused_kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace titan::init {
namespace {

constexpr int kBlocks = 16;              // Philox blocks per group
constexpr int64_t kGroup = 4 * kBlocks;  // elements per group: 4 words per block
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;  // round multipliers
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;  // key schedule (Weyl)

struct Key {
  uint32_t k0, k1;
};

uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

Key key_of(uint64_t seed, std::string_view name) {
  const uint64_t k = splitmix64(splitmix64(seed) ^ fnv1a64(name));
  return {static_cast<uint32_t>(k), static_cast<uint32_t>(k >> 32)};
}

// ---------------------------------------------------------------------------------------------
// The kernel: groups of 64 values, vectorized across the 16 blocks of a group (W blocks at a time).
// Every code path performs the same IEEE fp32 operations in the same order (no fused multiply-add,
// no library calls whose results could differ), so all give identical bits.

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#else
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's AVX-512 intrinsic headers
#endif

template <int W>
struct Vec {
  typedef uint32_t u32 __attribute__((vector_size(4 * W)));
  typedef int32_t i32 __attribute__((vector_size(4 * W)));
  typedef float f32 __attribute__((vector_size(4 * W)));
};

// Per instruction set: the width, 32x32 -> 64-bit products (hi, lo) and the IEEE square root.
struct IsaGeneric {
  static constexpr int W = 4;
  using V = Vec<W>;
  static inline void mul_hilo(const V::u32& a, uint32_t m, V::u32& hi, V::u32& lo) {
    for (int i = 0; i < W; ++i) {
      const uint64_t p = uint64_t{a[i]} * m;
      hi[i] = static_cast<uint32_t>(p >> 32);
      lo[i] = static_cast<uint32_t>(p);
    }
  }
  static inline void sqrt(V::f32& x) {
#if defined(__x86_64__)
    x = (V::f32)_mm_sqrt_ps((__m128)x);
#else
    for (int i = 0; i < W; ++i) x[i] = std::sqrt(x[i]);
#endif
  }
};

#if defined(__x86_64__)
struct IsaAvx2 {
  static constexpr int W = 8;
  using V = Vec<W>;
  __attribute__((target("avx2"))) static inline void mul_hilo(const V::u32& a, uint32_t m, V::u32& hi, V::u32& lo) {
    const __m256i av = (__m256i)a, mv = (__m256i)(V::u32{} + m);
    const __m256i even = _mm256_mul_epu32(av, mv), odd = _mm256_mul_epu32(_mm256_srli_epi64(av, 32), mv);
    hi = (V::u32)_mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
    lo = (V::u32)_mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  }
  __attribute__((target("avx2"))) static inline void sqrt(V::f32& x) { x = (V::f32)_mm256_sqrt_ps((__m256)x); }
};

struct IsaAvx512 {
  static constexpr int W = 16;
  using V = Vec<W>;
  __attribute__((target("avx512f"))) static inline void mul_hilo(const V::u32& a, uint32_t m, V::u32& hi, V::u32& lo) {
    const __m512i av = (__m512i)a, mv = (__m512i)(V::u32{} + m);
    const __m512i even = _mm512_mul_epu32(av, mv), odd = _mm512_mul_epu32(_mm512_srli_epi64(av, 32), mv);
    // Lane 2k takes dword 2k+1 (hi) or 2k (lo) of `even`, lane 2k+1 the same dword of `odd`.
    const __m512i hi_idx = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    hi = (V::u32)_mm512_permutex2var_epi32(even, hi_idx, odd);
    lo = (V::u32)_mm512_permutex2var_epi32(even, lo_idx, odd);
  }
  __attribute__((target("avx512f"))) static inline void sqrt(V::f32& x) { x = (V::f32)_mm512_sqrt_ps((__m512)x); }
};
#endif

struct KernelArgs {
  Key key;
  uint32_t attempt;
  bool bits;          // true: the Philox words; false: mean + std * normal
  float mean, std;
  int64_t first_group, groups;
  void* out;          // groups * 64 values (uint32 or fp32)
};

constexpr uint32_t kIota[kBlocks] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

template <class Isa>
inline void run_kernel(const KernelArgs& args) {
  constexpr int W = Isa::W;
  using u32 = typename Isa::V::u32;
  using i32 = typename Isa::V::i32;
  using f32 = typename Isa::V::f32;
  u32 iota;
  std::memcpy(&iota, kIota, sizeof iota);
  for (int64_t g = 0; g < args.groups; ++g) {
    for (int s = 0; s < kBlocks / W; ++s) {
      // Philox-4x32-10 of the W counters (block, block >> 32, attempt, 0). A group's first block is
      // a multiple of 16, so the low word of block + j never carries.
      const uint64_t block = static_cast<uint64_t>(args.first_group + g) * kBlocks + s * W;
      u32 c0 = iota + static_cast<uint32_t>(block), c1 = u32{} + static_cast<uint32_t>(block >> 32);
      u32 c2 = u32{} + args.attempt, c3 = u32{};
      uint32_t k0 = args.key.k0, k1 = args.key.k1;
      for (int r = 0; r < 10; ++r) {
        u32 hi0, lo0, hi1, lo1;
        Isa::mul_hilo(c0, kPhiloxM0, hi0, lo0);
        Isa::mul_hilo(c2, kPhiloxM1, hi1, lo1);
        c0 = hi1 ^ c1 ^ k0;
        c2 = hi0 ^ c3 ^ k1;
        c1 = lo1;
        c3 = lo0;
        k0 += kPhiloxW0;
        k1 += kPhiloxW1;
      }
      // Word l of block j goes to element 16 l + j of the group.
      const int64_t base = g * kGroup + s * W;
      if (args.bits) {
        uint32_t* out = static_cast<uint32_t*>(args.out) + base;
        std::memcpy(out, &c0, sizeof c0);
        std::memcpy(out + kBlocks, &c1, sizeof c1);
        std::memcpy(out + 2 * kBlocks, &c2, sizeof c2);
        std::memcpy(out + 3 * kBlocks, &c3, sizeof c3);
        continue;
      }
      float* out = static_cast<float*>(args.out) + base;
      for (int pair = 0; pair < 2; ++pair) {
        // Box-Muller: radius sqrt(-2 ln u1), angle 2 pi u2.
        const u32& w1 = pair ? c2 : c0;
        const u32& w2 = pair ? c3 : c1;
        // u1 in (0, 1]: 31 bits, the smallest 2^-33 (the radius reaches 6.77).
        const f32 u1 = __builtin_convertvector((i32)(w1 >> 1), f32) * 0x1p-31f + 0x1p-33f;
        // ln u1 = e ln 2 + ln m with m in [sqrt(1/2), sqrt(2)); ln m = 2 atanh(t), t = (m - 1) / (m + 1),
        // |t| < 0.172: the series to t^9 is exact to 2e-9.
        const u32 bits = (u32)u1;
        i32 e = (i32)(bits >> 23) - 126;
        f32 m = (f32)((bits & 0x007fffffu) | 0x3f000000u);  // [0.5, 1)
        const i32 low = m < 0.70710678118654752f;           // all ones where m < sqrt(1/2)
        e += low;
        m = m + (f32)((u32)m & (u32)low);
        const f32 t = (m - 1.0f) / (m + 1.0f);
        const f32 t2 = t * t;
        f32 series = t2 * (1.0f / 9) + (1.0f / 7);
        series = series * t2 + (1.0f / 5);
        series = series * t2 + (1.0f / 3);
        series = series * t2;
        const f32 ln_u1 = __builtin_convertvector(e, f32) * 0.69314718055994531f + ((t + t) + (t + t) * series);
        f32 radius = ln_u1 * -2.0f;
        Isa::sqrt(radius);
        radius = radius * args.std;
        // Angle: the nearest quarter turn q and phi in [-pi/4, pi/4) from 24 bits of w2.
        const u32 turn = w2 >> 8;                           // angle = turn * 2^-24 turns
        const u32 q = (turn + (1u << 21)) >> 22;            // 0..4
        const i32 rest = (i32)turn - (i32)(q << 22);        // [-2^21, 2^21)
        const f32 phi = __builtin_convertvector(rest, f32) * (1.57079632679489662f * 0x1p-22f);
        const f32 p2 = phi * phi;  // minimax polynomials on [-pi/4, pi/4] (Cephes sinf, cosf)
        const f32 sin_phi = phi + phi * p2 * (-1.6666654611e-1f + p2 * (8.3321608736e-3f + p2 * -1.9515295891e-4f));
        const f32 cos_phi =
            1.0f - 0.5f * p2 + p2 * p2 * (4.166664568298827e-2f + p2 * (-1.388731625493765e-3f + p2 * 2.443315711809948e-5f));
        // Rotate by q quarter turns: odd q swaps sine and cosine; signs from q (bit tricks: branch-free).
        const u32 swap = 0u - (q & 1u);
        const u32 cb = (u32)cos_phi, sb = (u32)sin_phi;
        const f32 cos_a = (f32)(((cb & ~swap) | (sb & swap)) ^ (((q + 1u) & 2u) << 30));
        const f32 sin_a = (f32)(((sb & ~swap) | (cb & swap)) ^ ((q & 2u) << 30));
        const f32 v0 = args.mean + radius * cos_a, v1 = args.mean + radius * sin_a;
        std::memcpy(out + 2 * pair * kBlocks, &v0, sizeof v0);
        std::memcpy(out + (2 * pair + 1) * kBlocks, &v1, sizeof v1);
      }
    }
  }
}

// One function per instruction set, everything inlined into it (flatten) and compiled for it.
__attribute__((flatten)) void run_generic(const KernelArgs& args) { run_kernel<IsaGeneric>(args); }
#if defined(__x86_64__)
__attribute__((target("avx2"), flatten)) void run_avx2(const KernelArgs& args) { run_kernel<IsaAvx2>(args); }
__attribute__((target("avx512f"), flatten)) void run_avx512(const KernelArgs& args) { run_kernel<IsaAvx512>(args); }
#endif

#if defined(__clang__)
#pragma STDC FP_CONTRACT DEFAULT
#else
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------------------------------------
// Choosing the code path.

struct Variant {
  const char* name;
  void (*run)(const KernelArgs&);
  bool supported;
};

std::vector<Variant> variants() {
  std::vector<Variant> out;
#if defined(__x86_64__)
  __builtin_cpu_init();
  out.push_back({"avx512", run_avx512, __builtin_cpu_supports("avx512f") != 0});
  out.push_back({"avx2", run_avx2, __builtin_cpu_supports("avx2") != 0});
#endif
  out.push_back({"generic", run_generic, true});
  std::erase_if(out, [](const Variant& v) { return !v.supported; });
  return out;
}

std::atomic<void (*)(const KernelArgs&)>& active_kernel() {
  static std::atomic<void (*)(const KernelArgs&)> k{variants().front().run};
  return k;
}

// ---------------------------------------------------------------------------------------------
// Distributions.

// What a parameter's elements are.
struct Draw {
  enum Kind { kBits, kNormal, kRejection, kInverseCdf } kind = kNormal;
  Key key{};
  uint32_t attempt = 0;  // kBits
  double mean = 0, std = 1;
  double a = 0, b = 0;                       // kRejection, kInverseCdf: cut-offs
  float a_in = 0, b_in = 0;                  // the floats nearest inside [a, b]
  double z_lo = 0, z_hi = 0, p_lo = 0, p_hi = 0;  // kInverseCdf: standardized (mirrored) bounds, their CDF
  bool mirror = false;
};

double norm_cdf(double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); }

// Inverse of the standard normal CDF, p in (0, 1): Acklam's rational approximation (1.2e-9) and one
// Halley step with erfc (to double precision).
double norm_icdf(double p) {
  static const double a[] = {-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
                             1.383577518672690e+02,  -3.066479806614716e+01, 2.506628277459239e+00};
  static const double b[] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                             6.680131188771972e+01,  -1.328068155288572e+01};
  static const double c[] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                             -2.549732539343734e+00, 4.374664141464968e+00,  2.938163982698783e+00};
  static const double d[] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                             3.754408661907416e+00};
  auto tail = [&](double q) {
    return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) /
           ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1);
  };
  double x;
  if (p < 0.02425) {
    x = tail(std::sqrt(-2 * std::log(p)));
  } else if (p > 1 - 0.02425) {
    x = -tail(std::sqrt(-2 * std::log1p(-p)));
  } else {
    const double q = p - 0.5, r = q * q;
    x = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q /
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1);
  }
  const double e = norm_cdf(x) - p;
  const double u = e * std::sqrt(2 * M_PI) * std::exp(x * x / 2);
  return x - u / (1 + x * u / 2);
}

constexpr int64_t kBatchGroups = 32;  // groups generated at once into a thread's buffer (8 KB)

// Groups [g, g + n) of `d` into buf (n * 64 values), attempts and inverse CDF included.
void generate(const Draw& d, void (*kernel)(const KernelArgs&), int64_t g, int64_t n, void* buf) {
  KernelArgs args{d.key, d.attempt, d.kind == Draw::kBits || d.kind == Draw::kInverseCdf,
                  static_cast<float>(d.mean), static_cast<float>(d.std), g, n, buf};
  kernel(args);
  if (d.kind == Draw::kInverseCdf) {
    // Uniform in (0, 1) from the word, mapped through the CDF between the cut-offs.
    for (int64_t i = 0; i < n * kGroup; ++i) {
      uint32_t w;
      std::memcpy(&w, static_cast<char*>(buf) + 4 * i, 4);
      const double u = (static_cast<double>(w) + 0.5) * 0x1p-32;
      double z = norm_icdf(d.p_lo + u * (d.p_hi - d.p_lo));
      z = std::clamp(std::isfinite(z) ? z : d.z_lo, d.z_lo, d.z_hi);
      const float v = std::clamp(static_cast<float>(d.mean + d.std * (d.mirror ? -z : z)), d.a_in, d.b_in);
      std::memcpy(static_cast<char*>(buf) + 4 * i, &v, 4);
    }
  }
  if (d.kind != Draw::kRejection) return;
  // An element outside [a, b] draws again with the next attempt counter until it falls inside.
  float* vals = static_cast<float*>(buf);
  const float a_in = d.a_in, b_in = d.b_in;  // a_in: the least float >= a
  auto outside = [&](float v) { return static_cast<int>(v < a_in) | static_cast<int>(v > b_in); };
  for (int64_t k = 0; k < n; ++k) {
    float* group = vals + k * kGroup;
    int any = 0;
    for (int i = 0; i < kGroup; ++i) any |= outside(group[i]);  // branch-free: vectorized
    if (!any) continue;
    uint64_t pending = 0;
    for (int i = 0; i < kGroup; ++i) pending |= static_cast<uint64_t>(outside(group[i])) << i;
    alignas(64) float again[kGroup];
    for (uint32_t attempt = 1; pending; ++attempt) {
      TITAN_ASSERT(attempt < (1u << 20), "trunc_normal: no draw inside [", d.a, ", ", d.b, "] after 2^20 attempts");
      kernel({d.key, attempt, false, args.mean, args.std, g + k, 1, again});
      for (uint64_t rest = pending; rest; rest &= rest - 1) {
        const int i = __builtin_ctzll(rest);
        if (!outside(again[i])) {
          group[i] = again[i];
          pending &= ~(uint64_t{1} << i);
        }
      }
    }
  }
}

// Elements [first, first + n) of `d`, in parallel over groups: store(i, values, count) receives the
// values (4 bytes each: fp32, or uint32 for kBits) of elements first + i, ..., first + i + count - 1.
template <class Store>
void fill(const Draw& d, int64_t first, int64_t n, const Store& store) {
  if (n == 0) return;
  auto* kernel = active_kernel().load();
  const int64_t g_begin = first / kGroup, g_end = (first + n - 1) / kGroup + 1;
  // Chunks of >= 2048 groups (128K elements): each thread's work is well above the fork cost.
  at::parallel_for(g_begin, g_end, 2048, [&](int64_t gb, int64_t ge) {
    alignas(64) float buf[kBatchGroups * kGroup];
    for (int64_t g = gb; g < ge; g += kBatchGroups) {
      const int64_t ng = std::min(kBatchGroups, ge - g);
      generate(d, kernel, g, ng, buf);
      const int64_t e0 = std::max(first, g * kGroup), e1 = std::min(first + n, (g + ng) * kGroup);
      store(e0 - first, buf + (e0 - g * kGroup), e1 - e0);
    }
  });
}

// Stores fp32 values into a contiguous CPU tensor of dtype T (rounding like Tensor::to: to nearest even).
template <class T>
auto store_into(at::Tensor& out) {
  return [dst = static_cast<T*>(out.data_ptr())](int64_t i, const float* src, int64_t count) {
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(dst + i, src, 4 * count);
    } else {
      for (int64_t k = 0; k < count; ++k) dst[i + k] = static_cast<T>(src[k]);
    }
  };
}

// Writes elements [first_element, first_element + out.numel()) into `out` (any dtype, device).
void write(at::Tensor& out, int64_t first_element, const Draw& d) {
  const int64_t n = out.numel();
  if (n == 0) return;
  TITAN_ASSERT(has_storage(out), "init: the tensor to fill has no storage");
  TITAN_ASSERT(first_element >= 0, "init: negative first element ", first_element);
  c10::NoGradGuard no_grad;
  if (out.device().is_cpu() && out.is_contiguous()) {  // straight into the tensor, converted on the way
    switch (out.scalar_type()) {
      case at::kFloat: return fill(d, first_element, n, store_into<float>(out));
      case at::kBFloat16: return fill(d, first_element, n, store_into<c10::BFloat16>(out));
      case at::kHalf: return fill(d, first_element, n, store_into<c10::Half>(out));
      case at::kDouble: return fill(d, first_element, n, store_into<double>(out));
      default: break;
    }
  }
  // Normal and truncated (by rejection) values of a CUDA tensor: generated on its GPU, the same bits.
  if (out.is_cuda() && (d.kind == Draw::kNormal || d.kind == Draw::kRejection)) {
    at::Tensor flat = out.is_contiguous() ? out.view({-1}) : at::empty({n}, out.options());
    if (nn::fused::init_normal(flat, first_element, d.key.k0, d.key.k1, static_cast<float>(d.mean),
                               static_cast<float>(d.std), d.kind == Draw::kRejection, d.a_in, d.b_in)) {
      if (!out.is_contiguous()) out.copy_(flat.view(out.sizes()));
      return;
    }
  }
  // Other devices, dtypes and layouts: through fp32 CPU buffers of at most 16 MB. For a device tensor,
  // two pinned buffers alternate: a chunk's copy to the device runs asynchronously on the current stream
  // while the next chunk is generated, and a buffer is refilled only once its copy has completed.
  at::Tensor flat = out.is_contiguous() ? out.view({-1}) : at::empty({n}, out.options());
  constexpr int64_t kChunk = int64_t{1} << 22;
  const bool to_device = !out.device().is_cpu();
  const int64_t buffer_elements = std::min(n, kChunk);
  const int buffers = to_device && n > kChunk ? 2 : 1;
  std::vector<at::Tensor> values;
  std::vector<std::optional<c10::Event>> copied(static_cast<size_t>(buffers));
  for (int b = 0; b < buffers; ++b)
    values.push_back(at::empty({buffer_elements}, at::TensorOptions().dtype(at::kFloat).pinned_memory(to_device)));
  const c10::impl::VirtualGuardImpl device_impl(out.device().type());
  for (int64_t off = 0, chunk = 0; off < n; off += kChunk, ++chunk) {
    const int64_t m = std::min(kChunk, n - off);
    const size_t b = static_cast<size_t>(chunk % buffers);
    if (copied[b]) copied[b]->synchronize();  // this buffer's previous copy has left it
    fill(d, first_element + off, m, store_into<float>(values[b]));
    flat.narrow(0, off, m).copy_(values[b].narrow(0, 0, m), /*non_blocking=*/to_device);
    if (to_device) {
      copied[b].emplace(out.device().type());
      copied[b]->record(device_impl.getStream(out.device()));
    }
  }
  for (auto& e : copied)  // the buffers are freed on return: every copy from them has completed
    if (e) e->synchronize();
  if (!out.is_contiguous()) out.copy_(flat.view(out.sizes()));
}

// The float nearest x on the inside of the cut-off (up: the lower one, down: the upper one).
float inside(double x, bool up) {
  float f = static_cast<float>(x);
  if (up && f < x) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  if (!up && f > x) f = std::nextafter(f, -std::numeric_limits<float>::infinity());
  return f;
}

}  // namespace

void normal(at::Tensor out, uint64_t seed, std::string_view name, int64_t first_element, double mean, double std) {
  TITAN_ASSERT(std::isfinite(mean) && std::isfinite(std) && std >= 0, "init::normal of ", name, ": mean ", mean,
               ", std ", std);
  Draw d;
  d.key = key_of(seed, name);
  d.mean = mean;
  d.std = std;
  write(out, first_element, d);
}

void trunc_normal(at::Tensor out, uint64_t seed, std::string_view name, int64_t first_element, double mean,
                  double std, double a, double b) {
  TITAN_ASSERT(std::isfinite(mean) && std::isfinite(std) && std > 0 && a < b, "init::trunc_normal of ", name,
               ": mean ", mean, ", std ", std, ", cut-offs [", a, ", ", b, "]");
  Draw d;
  d.key = key_of(seed, name);
  d.mean = mean;
  d.std = std;
  d.a = a;
  d.b = b;
  d.a_in = inside(a, /*up=*/true);
  d.b_in = inside(b, /*up=*/false);
  TITAN_ASSERT(d.a_in <= d.b_in, "init::trunc_normal of ", name, ": no float in [", a, ", ", b, "]");
  // Standardized; an interval right of 0 is mirrored so that its CDF values are small (precise).
  double lo = (a - mean) / std, hi = (b - mean) / std;
  d.mirror = lo + hi > 0;
  if (d.mirror) std::tie(lo, hi) = std::make_pair(-hi, -lo);
  d.z_lo = lo;
  d.z_hi = hi;
  d.p_lo = norm_cdf(lo);
  d.p_hi = norm_cdf(hi);
  // Rejection needs 1/p attempts per element on average: below 10% of the mass, the inverse CDF.
  // Cut-offs beyond the largest normal the generator makes (6.77 std) reject nothing.
  const double reach = 7.0 * std + 1e-6 * std::abs(mean);
  d.kind = a <= mean - reach && b >= mean + reach ? Draw::kNormal
           : d.p_hi - d.p_lo >= 0.1               ? Draw::kRejection
                                                  : Draw::kInverseCdf;
  write(out, first_element, d);
}

void ones(at::Tensor out) {
  if (out.numel() == 0) return;
  TITAN_ASSERT(has_storage(out), "init::ones: the tensor has no storage");
  c10::NoGradGuard no_grad;
  out.fill_(1.0);
}

void zeros(at::Tensor out) {
  if (out.numel() == 0) return;
  TITAN_ASSERT(has_storage(out), "init::zeros: the tensor has no storage");
  c10::NoGradGuard no_grad;
  out.zero_();
}

namespace detail {

std::array<uint32_t, 4> philox4x32_10(std::array<uint32_t, 4> c, std::array<uint32_t, 2> k) {
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = uint64_t{kPhiloxM0} * c[0], p1 = uint64_t{kPhiloxM1} * c[2];
    c = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k[0], static_cast<uint32_t>(p1),
         static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k[1], static_cast<uint32_t>(p0)};
    k = {k[0] + kPhiloxW0, k[1] + kPhiloxW1};
  }
  return c;
}

std::array<uint32_t, 2> philox_key(uint64_t seed, std::string_view name) {
  const Key k = key_of(seed, name);
  return {k.k0, k.k1};
}

std::vector<uint32_t> random_words(uint64_t seed, std::string_view name, int64_t first_element, int64_t n,
                                   uint32_t attempt) {
  Draw d;
  d.kind = Draw::kBits;
  d.key = key_of(seed, name);
  d.attempt = attempt;
  std::vector<uint32_t> out(n);
  fill(d, first_element, n, [&](int64_t i, const float* words, int64_t count) {
    std::memcpy(out.data() + i, words, 4 * count);
  });
  return out;
}

std::vector<std::string> kernel_variants() {
  std::vector<std::string> out;
  for (const auto& v : variants()) out.emplace_back(v.name);
  return out;
}

void set_kernel_variant(const std::string& name) {
  for (const auto& v : variants()) {
    if (name == v.name) {
      active_kernel().store(v.run);
      return;
    }
  }
  TITAN_ASSERT(false, "init: no kernel variant '", name, "' on this CPU");
}

}  // namespace detail
}  // namespace titan::init
