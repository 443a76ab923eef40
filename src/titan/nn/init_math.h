// One element of titan's layout-independent initialization (init.cpp), computed alone: the
// Philox-4x32-10 block that holds it and its Box-Muller normal, with the same IEEE fp32 operations in
// the same order as init.cpp's vectorized CPU kernel (each rounded on its own: no fused multiply-add),
// so the CUDA kernel that calls this (cuda/init_kernels.cu) writes the CPU's bits. The CPU tests
// compare these functions with the CPU kernel bit for bit.
//
// Element e of a parameter: group e / 64, position p = e % 64 in it; the block of the group's 16 is
// p % 16 (counter (group * 16 + p % 16, attempt)), and the word of the block p / 16. Words 0 and 1 make
// one Box-Muller pair (cosine, sine), words 2 and 3 another.
#pragma once

#include "titan/nn/host_device.h"

#include <cstdint>
#include <cstring>

namespace titan::init::math {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;

struct Words {
  uint32_t w[4];
};

TITAN_HD Words philox(uint64_t block, uint32_t attempt, uint32_t k0, uint32_t k1) {
  uint32_t c0 = static_cast<uint32_t>(block), c1 = static_cast<uint32_t>(block >> 32), c2 = attempt, c3 = 0;
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0, p1 = static_cast<uint64_t>(kPhiloxM1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0, n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return {{c0, c1, c2, c3}};
}

// Correctly rounded fp32 operations, never contracted into a fused multiply-add.
TITAN_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
TITAN_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
TITAN_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
TITAN_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
TITAN_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}

TITAN_HD uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
TITAN_HD float float_of(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

constexpr float kInv9 = 1.0f / 9, kInv7 = 1.0f / 7, kInv5 = 1.0f / 5, kInv3 = 1.0f / 3;
constexpr float kHalfPiOver2To22 = 1.57079632679489662f * 0x1p-22f;

// mean + std * radius * (cos or sin of the angle): the pair of words (w1, w2), the sine when `sine`.
TITAN_HD float box_muller(uint32_t w1, uint32_t w2, bool sine, float mean, float std) {
  const float u1 = add(mul(static_cast<float>(static_cast<int32_t>(w1 >> 1)), 0x1p-31f), 0x1p-33f);
  const uint32_t b = bits_of(u1);
  int32_t e = static_cast<int32_t>(b >> 23) - 126;
  float m = float_of((b & 0x007fffffu) | 0x3f000000u);
  if (m < 0.70710678118654752f) {
    e -= 1;
    m = add(m, m);
  } else {
    m = add(m, 0.0f);
  }
  const float t = div(sub(m, 1.0f), add(m, 1.0f));
  const float t2 = mul(t, t);
  float series = add(mul(t2, kInv9), kInv7);
  series = add(mul(series, t2), kInv5);
  series = add(mul(series, t2), kInv3);
  series = mul(series, t2);
  const float tt = add(t, t);
  const float ln_u1 = add(mul(static_cast<float>(e), 0.69314718055994531f), add(tt, mul(tt, series)));
  const float radius = mul(sqrt_rn(mul(ln_u1, -2.0f)), std);
  const uint32_t turn = w2 >> 8;
  const uint32_t q = (turn + (1u << 21)) >> 22;
  const int32_t rest = static_cast<int32_t>(turn) - static_cast<int32_t>(q << 22);
  const float phi = mul(static_cast<float>(rest), kHalfPiOver2To22);
  const float p2 = mul(phi, phi);
  const float sin_phi =
      add(phi, mul(mul(phi, p2), add(-1.6666654611e-1f, mul(p2, add(8.3321608736e-3f, mul(p2, -1.9515295891e-4f))))));
  const float cos_phi =
      add(sub(1.0f, mul(0.5f, p2)),
          mul(mul(p2, p2), add(4.166664568298827e-2f, mul(p2, add(-1.388731625493765e-3f, mul(p2, 2.443315711809948e-5f))))));
  const uint32_t swap = 0u - (q & 1u);
  const uint32_t cb = bits_of(cos_phi), sb = bits_of(sin_phi);
  const float trig = sine ? float_of(((sb & ~swap) | (cb & swap)) ^ ((q & 2u) << 30))
                          : float_of(((cb & ~swap) | (sb & swap)) ^ (((q + 1u) & 2u) << 30));
  return add(mean, mul(radius, trig));
}

// Element e's normal value at attempt `attempt`.
TITAN_HD float normal_at(int64_t e, uint32_t attempt, uint32_t k0, uint32_t k1, float mean, float std) {
  const uint64_t group = static_cast<uint64_t>(e) / 64;
  const uint32_t p = static_cast<uint32_t>(static_cast<uint64_t>(e) % 64);
  const Words w = philox(group * 16 + p % 16, attempt, k0, k1);
  const uint32_t word = p / 16;
  return word < 2 ? box_muller(w.w[0], w.w[1], word == 1, mean, std) : box_muller(w.w[2], w.w[3], word == 3, mean, std);
}

constexpr uint32_t kMaxAttempts = 1u << 20;

// Element e of a normal truncated to [a_in, b_in] by rejection: the first attempt inside. NaN after
// kMaxAttempts attempts outside (the CPU stops with an error there).
TITAN_HD float truncated_at(int64_t e, uint32_t k0, uint32_t k1, float mean, float std, float a_in, float b_in) {
  for (uint32_t attempt = 0; attempt < kMaxAttempts; ++attempt) {
    const float v = normal_at(e, attempt, k0, k1, mean, std);
    if (!(v < a_in) && !(v > b_in)) return v;
  }
  return float_of(0x7fc00000u);  // NaN
}

}  // namespace titan::init::math
