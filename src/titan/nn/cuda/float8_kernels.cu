// titan's float8 cast (launch.h's float8_cast): a scaled, clamped cast of a 2-D tensor to e4m3fn or
// e5m2, written in either layout, one pass. A tile of 32 x 32 elements is read along the input's
// contiguous dimension into shared memory and written along the output's, so a cast that also
// transposes (a column-major operand for cuBLAS) reads and writes whole lines.
#include "titan/nn/cuda/convert.cuh"
#include "titan/nn/cuda/launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace titan::nn::cuda_launch {
namespace {

constexpr int kTile = 32, kRows = 8;  // a block of 32 x 8 threads moves a 32 x 32 tile

__device__ __forceinline__ float scale_at(const float* scale, Float8Scale mode, int64_t r, int64_t c) {
  return mode == Float8Scale::kOne ? scale[0] : mode == Float8Scale::kPerRow ? scale[r] : scale[c];
}

// clamp(v, -max, max) to float8, to nearest even; NaN stays NaN (fminf and fmaxf would drop it).
template <bool kE4M3>
__device__ __forceinline__ __nv_fp8_storage_t to_fp8(float v) {
  constexpr float kMax = kE4M3 ? 448.0f : 57344.0f;
  if (!(v != v)) v = fminf(fmaxf(v, -kMax), kMax);
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kE4M3 ? __NV_E4M3 : __NV_E5M2);
}

template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kTile* kRows)
    float8_cast_kernel(const T* x, int64_t R, int64_t C, int64_t sr, int64_t sc, const float* scale, Float8Scale mode,
                       __nv_fp8_storage_t* out, bool out_column_major, int64_t tiles_c, int64_t tiles) {
  __shared__ float tile[kTile][kTile + 1];
  const bool in_columns = sc != 1 && sr == 1;  // the input's contiguous dimension is R
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t r0 = t / tiles_c * kTile, c0 = t % tiles_c * kTile;
#pragma unroll
    for (int k = 0; k < kTile; k += kRows) {
      const int i = in_columns ? tx : ty + k, j = in_columns ? ty + k : tx;  // (row, column) in the tile
      const int64_t r = r0 + i, c = c0 + j;
      if (r < R && c < C) tile[i][j] = to_float(x[r * sr + c * sc]) * scale_at(scale, mode, r, c);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kTile; k += kRows) {
      const int i = out_column_major ? tx : ty + k, j = out_column_major ? ty + k : tx;
      const int64_t r = r0 + i, c = c0 + j;
      if (r < R && c < C) out[out_column_major ? c * R + r : r * C + c] = to_fp8<kE4M3>(tile[i][j]);
    }
    __syncthreads();
  }
}

template <typename T>
void cast(const void* x, int64_t R, int64_t C, int64_t sr, int64_t sc, const float* scale, Float8Scale mode, bool e4m3,
          void* out, bool out_column_major, cudaStream_t stream) {
  const int64_t tiles_c = (C + kTile - 1) / kTile, tiles = (R + kTile - 1) / kTile * tiles_c;
  const int blocks = static_cast<int>(std::min<int64_t>(tiles, int64_t{1} << 20));
  const dim3 threads(kTile, kRows);
  auto* X = static_cast<const T*>(x);
  auto* O = static_cast<__nv_fp8_storage_t*>(out);
  if (e4m3)
    float8_cast_kernel<T, true><<<blocks, threads, 0, stream>>>(X, R, C, sr, sc, scale, mode, O, out_column_major,
                                                                tiles_c, tiles);
  else
    float8_cast_kernel<T, false><<<blocks, threads, 0, stream>>>(X, R, C, sr, sc, scale, mode, O, out_column_major,
                                                                 tiles_c, tiles);
}

}  // namespace

cudaError_t float8_cast(Dtype dtype, const void* x, int64_t R, int64_t C, int64_t sr, int64_t sc, const float* scale,
                        Float8Scale mode, bool e4m3, void* out, bool out_column_major, cudaStream_t stream) {
  if (R * C == 0) return cudaSuccess;
  switch (dtype) {
    case Dtype::kFloat: cast<float>(x, R, C, sr, sc, scale, mode, e4m3, out, out_column_major, stream); break;
    case Dtype::kBFloat16: cast<__nv_bfloat16>(x, R, C, sr, sc, scale, mode, e4m3, out, out_column_major, stream); break;
    case Dtype::kHalf: cast<__half>(x, R, C, sr, sc, scale, mode, e4m3, out, out_column_major, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace titan::nn::cuda_launch
