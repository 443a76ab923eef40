// The per-element arithmetic of titan's fused CUDA kernels (nn/cuda/fused_kernels.cu), in fp32, as
// functions that compile for the host too: the CPU tests check them against ATen's formulations.
//
//   swiglu:       silu(a) * b, and its gradients (ATen's silu and silu_backward formulas)
//   rotate:       (xr + i xi) * (c + i s), a RoPE pair times its table entry
//   MaxSum:       a running log-sum-exp (max m and sum of exp(x - m)), added to one value at a time
//                 and merged with another; NaN inputs stay NaN, -inf inputs add nothing
//   ce_grad:      d/dx of -log softmax(x)[y] for one entry, times the upstream gradient g
#pragma once

#include "titan/nn/host_device.h"

#include <cmath>

namespace titan::nn::fused_math {

TITAN_HD float sigmoid(float a) { return 1.0f / (1.0f + expf(-a)); }

TITAN_HD float swiglu(float a, float b) { return a / (1.0f + expf(-a)) * b; }

struct SwigluGrads {
  float da, db;
};

// g * b * s * (1 + a * (1 - s)) with s = sigmoid(a) (silu's derivative times g * b), and g * silu(a).
TITAN_HD SwigluGrads swiglu_backward(float g, float a, float b) {
  const float s = sigmoid(a);
  return {g * b * s * (1.0f + a * (1.0f - s)), g * (a * s)};
}

struct Pair {
  float re, im;
};

TITAN_HD Pair rotate(float xr, float xi, float c, float s) { return {xr * c - xi * s, xr * s + xi * c}; }

struct MaxSum {
  float m = -INFINITY;  // the largest value added (-inf: none yet)
  float s = 0.0f;       // sum of exp(x - m) over the values added
};

TITAN_HD MaxSum lse_add(MaxSum acc, float x) {
  if (x == -INFINITY) return acc;                          // exp(-inf) adds nothing
  if (x > acc.m) return {x, acc.s * expf(acc.m - x) + 1.0f};  // acc.m -inf: 0 * 0 + 1
  return {acc.m, acc.s + expf(x - acc.m)};                 // a NaN x lands here and makes s NaN
}

TITAN_HD MaxSum lse_merge(MaxSum a, MaxSum b) {
  if (a.m == -INFINITY) return {b.m, b.s + a.s};  // a.s is 0, or NaN that must stay
  if (b.m == -INFINITY) return {a.m, a.s + b.s};
  const float m = a.m > b.m ? a.m : b.m;
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// log(sum(exp(x))): -inf for no values (or only -inf ones), NaN when a NaN was added.
TITAN_HD float lse_value(MaxSum a) { return a.m + logf(a.s); }

TITAN_HD float ce_grad(float x, float lse, bool is_label, float g) {
  return (expf(x - lse) - (is_label ? 1.0f : 0.0f)) * g;
}

}  // namespace titan::nn::fused_math
