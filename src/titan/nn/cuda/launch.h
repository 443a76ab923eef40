// Launchers of titan's fused CUDA kernels (fused_kernels.cu), on raw device pointers: this header
// and the .cu see no ATen, so nvcc compiles only the kernels. The ATen-facing side, with its checks
// of shapes, dtypes, devices and alignment, is nn/fused_kernels.{h,cpp}.
//
// Every launcher enqueues on `stream` and returns the launch's error (cudaSuccess or the error of
// cudaGetLastError). `vec`: every pointer is 16-byte aligned and each row (or the whole tensor, for
// the elementwise kernels) has a multiple of 16 bytes, so 16-byte loads and stores are used.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace titan::nn::cuda_launch {

enum class Dtype : int { kFloat, kBFloat16, kHalf };

// out = silu(a) * b over n elements (all contiguous, of `dtype`), in fp32, rounded once.
cudaError_t swiglu_forward(Dtype dtype, const void* a, const void* b, void* out, int64_t n, bool vec,
                           cudaStream_t stream);

// da = g * silu'(a) * b, db = g * silu(a).
cudaError_t swiglu_backward(Dtype dtype, const void* g, const void* a, const void* b, void* da, void* db,
                            int64_t n, bool vec, cudaStream_t stream);

// x (B, S, n, E) with strides (sb, ss, sh, 1) in elements; out contiguous (B, S, n, E). Each pair
// (x[..., 2i], x[..., 2i+1]) times cis[s, i] (complex64 as float pairs, (S, E/2) contiguous), or its
// conjugate when `inverse`.
struct RopeShape {
  int64_t B, S, n, E;
  int64_t sb, ss, sh;
};
cudaError_t rope(Dtype dtype, const void* x, const float* cis, void* out, const RopeShape& shape, bool inverse,
                 cudaStream_t stream);

// Per row r of x (N rows of V values, row r at x + r * row_stride): lse[r] = log(sum(exp(x[r]))) and
// loss[r] = lse[r] - x[r][labels[r]], 0 where labels[r] == ignore_index, NaN for a label outside
// [0, V). lse and loss are fp32 (N).
cudaError_t cross_entropy_forward(Dtype dtype, const void* x, int64_t N, int64_t V, int64_t row_stride,
                                  const int64_t* labels, int64_t ignore_index, float* lse, float* loss, bool vec,
                                  cudaStream_t stream);

// grad (N, V contiguous, of `dtype`) = g * (exp(x - lse) - onehot(label)) per row, 0 on ignored rows,
// NaN on rows whose label is outside [0, V); g is one fp32 value on the device.
cudaError_t cross_entropy_backward(Dtype dtype, const void* x, int64_t N, int64_t V, int64_t row_stride,
                                   const int64_t* labels, int64_t ignore_index, const float* lse, const float* g,
                                   void* grad, bool vec, cudaStream_t stream);

// out (n contiguous values of `dtype`) = elements [first, first + n) of a parameter's initial values
// (init.cpp's generator under key (k0, k1)): normal with mean and std, or, when `truncated`, redrawn
// until inside [a_in, b_in]; the CPU's bits, rounded to `dtype` to nearest even (init_kernels.cu).
cudaError_t init_normal(Dtype dtype, void* out, int64_t first, int64_t n, uint32_t k0, uint32_t k1, float mean,
                        float std, bool truncated, float a_in, float b_in, cudaStream_t stream);

// out = float8(clamp(x[r, c] * scale, -max, max)), rounded to nearest even, for the R x C values of x
// at x + r * sr + c * sc (elements of `dtype`), as e4m3fn (max 448) or e5m2 (max 57344); NaN stays
// NaN. `scale`: fp32 on the device, one value, one per row (R) or one per column (C), as `mode` says.
// out (one byte each) is row-major (r * C + c) or, when `out_column_major`, column-major (c * R + r).
enum class Float8Scale : int { kOne, kPerRow, kPerColumn };
cudaError_t float8_cast(Dtype dtype, const void* x, int64_t R, int64_t C, int64_t sr, int64_t sc, const float* scale,
                        Float8Scale mode, bool e4m3, void* out, bool out_column_major, cudaStream_t stream);

// The MoE layer's combine of routed rows into tokens (moe.cpp). out: the routed rows (any count, D
// contiguous values of `dtype` each); row (T * K int64): for token t's k-th copy j = t * K + k, the
// row of out that holds it; w (T * K fp32) its weight, or nullptr for weights of 1.
// Forward: y[t] = sum over k of round(out[row[j]] * w[j]), each product in fp32 rounded to `dtype`,
// summed in fp32 in the order of k, rounded once; y (T, D) contiguous.
// Backward (w given): grad_out[row[j]] = round(gy[t] * w[j]) and grad_w[j] = the fp32 dot product of
// gy[t] and out[row[j]]; gy (T, D) contiguous. Rows of grad_out no j names are not written.
cudaError_t moe_combine_forward(Dtype dtype, const void* out, const int64_t* row, const float* w, void* y, int64_t T,
                                int64_t K, int64_t D, bool vec, cudaStream_t stream);
cudaError_t moe_combine_backward(Dtype dtype, const void* gy, const void* out, const int64_t* row, const float* w,
                                 void* grad_out, float* grad_w, int64_t T, int64_t K, int64_t D, bool vec,
                                 cudaStream_t stream);

}  // namespace titan::nn::cuda_launch
