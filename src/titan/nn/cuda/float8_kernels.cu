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
// Blocks per launch at most (dozens per multiprocessor); each block loops over the rest.
constexpr int64_t kMaxBlocks = 4096;

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
  // Threads along R where the input is contiguous along R, or where R is the only dimension with
  // more than one element (so that a single column or row still fills the tile's threads).
  const bool in_columns = C == 1 || (R > 1 && sr == 1 && sc != 1);
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

// Eight consecutive elements of T from 16-byte-aligned memory, as fp32.
template <typename T>
__device__ __forceinline__ void load8(const T* p, float (&v)[8]) {
  if constexpr (sizeof(T) == 4) {
    const uint4 a = reinterpret_cast<const uint4*>(p)[0], b = reinterpret_cast<const uint4*>(p)[1];
    const T* pa = reinterpret_cast<const T*>(&a);
    const T* pb = reinterpret_cast<const T*>(&b);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[k] = to_float(pa[k]);
      v[4 + k] = to_float(pb[k]);
    }
  } else {
    const uint4 a = reinterpret_cast<const uint4*>(p)[0];
    const T* pa = reinterpret_cast<const T*>(&a);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = to_float(pa[k]);
  }
}

// Where the scale varies in the vectorized kernels' coordinates: not at all, along a line (one per
// position) or from line to line.
enum class LineScale : int { kOne, kPerPosition, kPerLine };

__device__ __forceinline__ float line_scale(const float* scale, LineScale mode, int64_t line, int64_t pos) {
  return mode == LineScale::kOne ? scale[0] : mode == LineScale::kPerLine ? scale[line] : scale[pos];
}

// Without transposing: `lines` lines of L contiguous elements (line i at x + i * line_stride) to
// lines of L float8 bytes, packed (line i at out + i * L); eight elements per thread, 16-byte loads
// and 8-byte stores. L is a multiple of 8; x and each line 16-byte aligned.
template <typename T, bool kE4M3>
__global__ void float8_cast_lines_kernel(const T* x, int64_t lines, int64_t L, int64_t line_stride, const float* scale,
                                         LineScale mode, __nv_fp8_storage_t* out) {
  const int64_t per_line = L / 8, vectors = lines * per_line;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < vectors;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t line = v / per_line, pos = v % per_line * 8;
    float f[8];
    load8(x + line * line_stride + pos, f);
    uint2 packed;
    auto* bytes = reinterpret_cast<__nv_fp8_storage_t*>(&packed);
#pragma unroll
    for (int k = 0; k < 8; ++k) bytes[k] = to_fp8<kE4M3>(f[k] * line_scale(scale, mode, line, pos + k));
    reinterpret_cast<uint2*>(out + line * L + pos)[0] = packed;
  }
}

// Transposing: element (u, w) at x + w * w_stride + u (u contiguous; U and W multiples of 8, x and
// each w-line 16-byte aligned) to out + u * W + w (w contiguous). 64 x 64 tiles: each thread loads
// eight u-consecutive elements twice (16-byte loads), the float8 bytes go to shared memory as
// [u][w], then each thread stores eight w-consecutive bytes twice (8-byte stores).
constexpr int kWideTile = 64, kWideThreads = 256, kWidePitch = kWideTile + 8;  // pitch: 8-byte aligned rows

template <typename T, bool kE4M3>
__global__ void __launch_bounds__(kWideThreads)
    float8_cast_transpose_kernel(const T* x, int64_t U, int64_t W, int64_t w_stride, const float* scale,
                                 Float8Scale mode_u_w /*kPerRow: per u, kPerColumn: per w*/, __nv_fp8_storage_t* out,
                                 int64_t tiles_u, int64_t tiles) {
  __shared__ __align__(16) __nv_fp8_storage_t tile[kWideTile][kWidePitch];
  constexpr int kVectors = kWideTile * kWideTile / 8;  // 512 vectors of 8 per tile
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t u0 = t % tiles_u * kWideTile, w0 = t / tiles_u * kWideTile;
#pragma unroll
    for (int k = 0; k < kVectors / kWideThreads; ++k) {
      const int vid = threadIdx.x + k * kWideThreads;
      const int wl = vid / (kWideTile / 8), ul = vid % (kWideTile / 8) * 8;
      const int64_t u = u0 + ul, w = w0 + wl;
      if (u < U && w < W) {
        float f[8];
        load8(x + w * w_stride + u, f);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float s = mode_u_w == Float8Scale::kOne ? scale[0] : mode_u_w == Float8Scale::kPerRow ? scale[u + j] : scale[w];
          tile[ul + j][wl] = to_fp8<kE4M3>(f[j] * s);
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kVectors / kWideThreads; ++k) {
      const int vid = threadIdx.x + k * kWideThreads;
      const int ul = vid / (kWideTile / 8), wl = vid % (kWideTile / 8) * 8;
      const int64_t u = u0 + ul, w = w0 + wl;
      if (u < U && w < W) reinterpret_cast<uint2*>(out + u * W + w)[0] = reinterpret_cast<const uint2*>(&tile[ul][wl])[0];
    }
    __syncthreads();
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
void cast(const void* x, int64_t R, int64_t C, int64_t sr, int64_t sc, const float* scale, Float8Scale mode, bool e4m3,
          void* out, bool out_column_major, cudaStream_t stream) {
  auto* X = static_cast<const T*>(x);
  auto* O = static_cast<__nv_fp8_storage_t*>(out);
  const int64_t es = sizeof(T);
  const bool x16 = aligned16(x) && reinterpret_cast<uintptr_t>(out) % 8 == 0;
  const bool c_fast = sc == 1 && C % 8 == 0 && (sr * es) % 16 == 0;  // rows: 16-byte vectors
  const bool r_fast = sr == 1 && R % 8 == 0 && (sc * es) % 16 == 0;  // columns: 16-byte vectors
  // Without transposing: lines along the contiguous dimension, vectorized.
  if (x16 && ((c_fast && !out_column_major) || (r_fast && out_column_major))) {
    const bool rows = c_fast && !out_column_major;
    const int64_t lines = rows ? R : C, L = rows ? C : R, stride = rows ? sr : sc;
    LineScale m = LineScale::kOne;
    if (mode == Float8Scale::kPerRow) m = rows ? LineScale::kPerLine : LineScale::kPerPosition;
    if (mode == Float8Scale::kPerColumn) m = rows ? LineScale::kPerPosition : LineScale::kPerLine;
    const int blocks = static_cast<int>(std::min<int64_t>((lines * L / 8 + 255) / 256, kMaxBlocks));
    if (e4m3) float8_cast_lines_kernel<T, true><<<blocks, 256, 0, stream>>>(X, lines, L, stride, scale, m, O);
    else float8_cast_lines_kernel<T, false><<<blocks, 256, 0, stream>>>(X, lines, L, stride, scale, m, O);
    return;
  }
  // Transposing, vectorized: u the input's contiguous dimension, w the output's.
  if (x16 && ((c_fast && out_column_major && R % 8 == 0) || (r_fast && !out_column_major && C % 8 == 0))) {
    const bool a = c_fast && out_column_major;  // u = columns, w = rows; else u = rows, w = columns
    const int64_t U = a ? C : R, W = a ? R : C, w_stride = a ? sr : sc;
    Float8Scale m = Float8Scale::kOne;  // in (u, w): kPerRow = per u, kPerColumn = per w
    if (mode == Float8Scale::kPerRow) m = a ? Float8Scale::kPerColumn : Float8Scale::kPerRow;
    if (mode == Float8Scale::kPerColumn) m = a ? Float8Scale::kPerRow : Float8Scale::kPerColumn;
    const int64_t tiles_u = (U + kWideTile - 1) / kWideTile, tiles_w = (W + kWideTile - 1) / kWideTile;
    const int64_t tiles = tiles_u * tiles_w;
    const int blocks = static_cast<int>(std::min<int64_t>(tiles, kMaxBlocks));
    if (e4m3)
      float8_cast_transpose_kernel<T, true><<<blocks, kWideThreads, 0, stream>>>(X, U, W, w_stride, scale, m, O, tiles_u, tiles);
    else
      float8_cast_transpose_kernel<T, false><<<blocks, kWideThreads, 0, stream>>>(X, U, W, w_stride, scale, m, O, tiles_u, tiles);
    return;
  }
  // Any other strides or sizes: 32 x 32 tiles, one element per thread.
  const int64_t tiles_c = (C + kTile - 1) / kTile, tiles = (R + kTile - 1) / kTile * tiles_c;
  const int blocks = static_cast<int>(std::min<int64_t>(tiles, kMaxBlocks));
  const dim3 threads(kTile, kRows);
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
