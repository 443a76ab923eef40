// titan's fused CUDA kernels: SwiGLU, RoPE, the cross-entropy rows and the MoE layer's combine of
// routed rows (launch.h says what each computes). The arithmetic is fused_math.h's, shared with the CPU tests; these kernels only load,
// convert to fp32, apply it and store, each in one pass over its tensors.
#include "titan/nn/cuda/convert.cuh"
#include "titan/nn/cuda/launch.h"
#include "titan/nn/fused_math.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace titan::nn::cuda_launch {
namespace {

// 16 bytes of T, loaded and stored at once.
template <typename T>
struct Pack {
  static constexpr int kN = 16 / sizeof(T);
  uint4 raw;
  __device__ __forceinline__ float get(int k) const { return to_float(reinterpret_cast<const T*>(&raw)[k]); }
  __device__ __forceinline__ void set(int k, float v) { reinterpret_cast<T*>(&raw)[k] = from_float<T>(v); }
};

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p, int64_t pack_index) {
  return Pack<T>{reinterpret_cast<const uint4*>(p)[pack_index]};
}
template <typename T>
__device__ __forceinline__ void store_pack(T* p, int64_t pack_index, const Pack<T>& v) {
  reinterpret_cast<uint4*>(p)[pack_index] = v.raw;
}

constexpr int kThreads = 256;

int elementwise_blocks(int64_t items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, 1 << 16)));
}

__device__ __forceinline__ int64_t first_index() { return blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; }
__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

template <typename T, bool kVec>
__global__ void swiglu_forward_kernel(const T* a, const T* b, T* out, int64_t n) {
  int64_t done = 0;
  if constexpr (kVec) {
    constexpr int N = Pack<T>::kN;
    const int64_t packs = n / N;
    for (int64_t p = first_index(); p < packs; p += grid_stride()) {
      const Pack<T> pa = load_pack(a, p), pb = load_pack(b, p);
      Pack<T> po;
#pragma unroll
      for (int k = 0; k < N; ++k) po.set(k, fused_math::swiglu(pa.get(k), pb.get(k)));
      store_pack(out, p, po);
    }
    done = packs * N;
  }
  for (int64_t i = done + first_index(); i < n; i += grid_stride())
    out[i] = from_float<T>(fused_math::swiglu(to_float(a[i]), to_float(b[i])));
}

template <typename T, bool kVec>
__global__ void swiglu_backward_kernel(const T* g, const T* a, const T* b, T* da, T* db, int64_t n) {
  int64_t done = 0;
  if constexpr (kVec) {
    constexpr int N = Pack<T>::kN;
    const int64_t packs = n / N;
    for (int64_t p = first_index(); p < packs; p += grid_stride()) {
      const Pack<T> pg = load_pack(g, p), pa = load_pack(a, p), pb = load_pack(b, p);
      Pack<T> pda, pdb;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const fused_math::SwigluGrads d = fused_math::swiglu_backward(pg.get(k), pa.get(k), pb.get(k));
        pda.set(k, d.da);
        pdb.set(k, d.db);
      }
      store_pack(da, p, pda);
      store_pack(db, p, pdb);
    }
    done = packs * N;
  }
  for (int64_t i = done + first_index(); i < n; i += grid_stride()) {
    const fused_math::SwigluGrads d = fused_math::swiglu_backward(to_float(g[i]), to_float(a[i]), to_float(b[i]));
    da[i] = from_float<T>(d.da);
    db[i] = from_float<T>(d.db);
  }
}

// One thread per pair. Index is int32_t when every offset fits, int64_t otherwise.
template <typename T, typename Index>
__global__ void rope_kernel(const T* x, const float2* cis, T* out, Index S, Index n, Index E2, Index sb, Index ss,
                            Index sh, Index pairs, float sign) {
  for (Index p = static_cast<Index>(first_index()); p < pairs; p += static_cast<Index>(grid_stride())) {
    Index t = p / E2;
    const Index e2 = p - t * E2;
    const Index h = t % n;
    t /= n;
    const Index s = t % S;
    const Index b = t / S;
    const T* xp = x + b * sb + s * ss + h * sh + 2 * e2;
    const float2 c = cis[s * E2 + e2];
    const fused_math::Pair r = fused_math::rotate(to_float(xp[0]), to_float(xp[1]), c.x, sign * c.y);
    out[2 * p] = from_float<T>(r.re);
    out[2 * p + 1] = from_float<T>(r.im);
  }
}

constexpr int kRowThreads = 512;

// Reduces every thread's MaxSum to thread 0's (the others' results are unspecified).
__device__ __forceinline__ fused_math::MaxSum block_lse(fused_math::MaxSum acc) {
  __shared__ float shared_m[kRowThreads / 32], shared_s[kRowThreads / 32];
  for (int o = 16; o > 0; o >>= 1)
    acc = fused_math::lse_merge(acc, {__shfl_xor_sync(0xffffffffu, acc.m, o), __shfl_xor_sync(0xffffffffu, acc.s, o)});
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    shared_m[warp] = acc.m;
    shared_s[warp] = acc.s;
  }
  __syncthreads();
  if (warp == 0) {
    acc = lane < static_cast<int>(blockDim.x / 32) ? fused_math::MaxSum{shared_m[lane], shared_s[lane]} : fused_math::MaxSum{};
    for (int o = 16; o > 0; o >>= 1)
      acc = fused_math::lse_merge(acc, {__shfl_xor_sync(0xffffffffu, acc.m, o), __shfl_xor_sync(0xffffffffu, acc.s, o)});
  }
  return acc;
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kRowThreads) cross_entropy_forward_kernel(const T* x, int64_t V, int64_t row_stride,
                                                                            const int64_t* labels, int64_t ignore_index,
                                                                            float* lse, float* loss) {
  const int64_t row = blockIdx.x;
  const T* r = x + row * row_stride;
  fused_math::MaxSum acc;
  int64_t done = 0;
  if constexpr (kVec) {
    constexpr int N = Pack<T>::kN;
    const int64_t packs = V / N;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T> v = load_pack(r, p);
#pragma unroll
      for (int k = 0; k < N; ++k) acc = fused_math::lse_add(acc, v.get(k));
    }
    done = packs * N;
  }
  for (int64_t j = done + threadIdx.x; j < V; j += blockDim.x) acc = fused_math::lse_add(acc, to_float(r[j]));
  acc = block_lse(acc);
  if (threadIdx.x == 0) {
    const float l = fused_math::lse_value(acc);
    const int64_t y = labels[row];
    lse[row] = l;
    loss[row] = y == ignore_index ? 0.0f : (y >= 0 && y < V ? l - to_float(r[y]) : NAN);
  }
}

template <typename T, bool kVec>
__global__ void __launch_bounds__(kRowThreads) cross_entropy_backward_kernel(const T* x, int64_t V, int64_t row_stride,
                                                                             const int64_t* labels, int64_t ignore_index,
                                                                             const float* lse, const float* g, T* grad) {
  const int64_t row = blockIdx.x;
  const T* r = x + row * row_stride;
  T* out = grad + row * V;
  const int64_t y = labels[row];
  const bool valid = y != ignore_index;
  // A label outside the vocabulary: NaN gradients for its row (its loss is NaN already), so that the
  // step's gradient norm is NaN and the NaN policy stops or skips it, rather than a finite update.
  const float gr = valid ? (y >= 0 && y < V ? *g : NAN) : 0.0f, l = lse[row];
  int64_t done = 0;
  if constexpr (kVec) {
    constexpr int N = Pack<T>::kN;
    const int64_t packs = V / N;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack<T> v = load_pack(r, p);
      Pack<T> o;
#pragma unroll
      for (int k = 0; k < N; ++k) o.set(k, valid ? fused_math::ce_grad(v.get(k), l, p * N + k == y, gr) : 0.0f);
      store_pack(out, p, o);
    }
    done = packs * N;
  }
  for (int64_t j = done + threadIdx.x; j < V; j += blockDim.x)
    out[j] = from_float<T>(valid ? fused_math::ce_grad(to_float(r[j]), l, j == y, gr) : 0.0f);
}

template <template <typename> class Fn, typename... Args>
cudaError_t dispatch(Dtype dtype, Args&&... args) {
  switch (dtype) {
    case Dtype::kFloat: Fn<float>::run(args...); break;
    case Dtype::kBFloat16: Fn<__nv_bfloat16>::run(args...); break;
    case Dtype::kHalf: Fn<__half>::run(args...); break;
  }
  return cudaGetLastError();
}

template <typename T>
struct SwigluForward {
  static void run(const void* a, const void* b, void* out, int64_t n, bool vec, cudaStream_t stream) {
    const int blocks = elementwise_blocks(vec ? n / Pack<T>::kN : n);
    auto* A = static_cast<const T*>(a);
    auto* B = static_cast<const T*>(b);
    auto* O = static_cast<T*>(out);
    if (vec) swiglu_forward_kernel<T, true><<<blocks, kThreads, 0, stream>>>(A, B, O, n);
    else swiglu_forward_kernel<T, false><<<blocks, kThreads, 0, stream>>>(A, B, O, n);
  }
};

template <typename T>
struct SwigluBackward {
  static void run(const void* g, const void* a, const void* b, void* da, void* db, int64_t n, bool vec,
                  cudaStream_t stream) {
    const int blocks = elementwise_blocks(vec ? n / Pack<T>::kN : n);
    auto* G = static_cast<const T*>(g);
    auto* A = static_cast<const T*>(a);
    auto* B = static_cast<const T*>(b);
    if (vec)
      swiglu_backward_kernel<T, true><<<blocks, kThreads, 0, stream>>>(G, A, B, static_cast<T*>(da), static_cast<T*>(db), n);
    else
      swiglu_backward_kernel<T, false><<<blocks, kThreads, 0, stream>>>(G, A, B, static_cast<T*>(da), static_cast<T*>(db), n);
  }
};

template <typename T>
struct Rope {
  static void run(const void* x, const float* cis, void* out, const RopeShape& s, bool inverse, cudaStream_t stream) {
    const int64_t pairs = s.B * s.S * s.n * (s.E / 2);
    // The largest offset read: the last element of x, or of out (pairs * 2), or of cis.
    const int64_t last_x = (s.B - 1) * s.sb + (s.S - 1) * s.ss + (s.n - 1) * s.sh + s.E;
    const bool narrow = std::max(last_x, 2 * pairs) < (int64_t{1} << 31) - 1;
    const int blocks = elementwise_blocks(pairs);
    const float sign = inverse ? -1.0f : 1.0f;
    auto* X = static_cast<const T*>(x);
    auto* C = reinterpret_cast<const float2*>(cis);
    auto* O = static_cast<T*>(out);
    if (narrow)
      rope_kernel<T, int32_t><<<blocks, kThreads, 0, stream>>>(
          X, C, O, static_cast<int32_t>(s.S), static_cast<int32_t>(s.n), static_cast<int32_t>(s.E / 2),
          static_cast<int32_t>(s.sb), static_cast<int32_t>(s.ss), static_cast<int32_t>(s.sh),
          static_cast<int32_t>(pairs), sign);
    else
      rope_kernel<T, int64_t><<<blocks, kThreads, 0, stream>>>(X, C, O, s.S, s.n, s.E / 2, s.sb, s.ss, s.sh, pairs, sign);
  }
};

template <typename T>
struct CrossEntropyForward {
  static void run(const void* x, int64_t N, int64_t V, int64_t row_stride, const int64_t* labels, int64_t ignore_index,
                  float* lse, float* loss, bool vec, cudaStream_t stream) {
    auto* X = static_cast<const T*>(x);
    if (vec)
      cross_entropy_forward_kernel<T, true><<<N, kRowThreads, 0, stream>>>(X, V, row_stride, labels, ignore_index, lse, loss);
    else
      cross_entropy_forward_kernel<T, false><<<N, kRowThreads, 0, stream>>>(X, V, row_stride, labels, ignore_index, lse, loss);
  }
};

template <typename T>
struct CrossEntropyBackward {
  static void run(const void* x, int64_t N, int64_t V, int64_t row_stride, const int64_t* labels, int64_t ignore_index,
                  const float* lse, const float* g, void* grad, bool vec, cudaStream_t stream) {
    auto* X = static_cast<const T*>(x);
    auto* G = static_cast<T*>(grad);
    if (vec)
      cross_entropy_backward_kernel<T, true><<<N, kRowThreads, 0, stream>>>(X, V, row_stride, labels, ignore_index, lse, g, G);
    else
      cross_entropy_backward_kernel<T, false><<<N, kRowThreads, 0, stream>>>(X, V, row_stride, labels, ignore_index, lse, g, G);
  }
};

// MoE combine, forward: one block per token (blocks loop over tokens), each thread a 16-byte pack
// (or one element) of the row at a time; the K rows of a token read in the order of k and summed
// in fp32. w == nullptr: every weight 1 (the products are the rows themselves). The product is
// rounded on its own (__fmul_rn: never contracted into the sum's fused multiply-add), as on the CPU.
template <typename T, bool kVec>
__global__ void moe_combine_forward_kernel(const T* out, const int64_t* row, const float* w, T* y, int64_t T_,
                                           int64_t K, int64_t D) {
  constexpr int N = kVec ? Pack<T>::kN : 1;
  const int64_t units = D / N;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      float acc[N];
#pragma unroll
      for (int i = 0; i < N; ++i) acc[i] = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t j = t * K + k;
        const T* src = out + row[j] * D;
        const float wj = w != nullptr ? w[j] : 1.0f;
        if constexpr (kVec) {
          const Pack<T> p = load_pack(src, u);
#pragma unroll
          for (int i = 0; i < N; ++i) acc[i] += to_float(from_float<T>(__fmul_rn(p.get(i), wj)));
        } else {
          acc[0] += to_float(from_float<T>(__fmul_rn(to_float(src[u]), wj)));
        }
      }
      if constexpr (kVec) {
        Pack<T> p;
#pragma unroll
        for (int i = 0; i < N; ++i) p.set(i, acc[i]);
        store_pack(y + t * D, u, p);
      } else {
        y[t * D + u] = from_float<T>(acc[0]);
      }
    }
  }
}

// MoE combine, backward: one block per token; for each of its K rows, the row's gradient
// (gy[t] * w[j], rounded to T) written to the row, and the weight's gradient (the fp32 dot product
// of gy[t] and the row) reduced over the block: each warp's sum to shared memory, then in order.
template <typename T, bool kVec>
__global__ void moe_combine_backward_kernel(const T* gy, const T* out, const int64_t* row, const float* w,
                                            T* grad_out, float* grad_w, int64_t T_, int64_t K, int64_t D) {
  constexpr int N = kVec ? Pack<T>::kN : 1;
  extern __shared__ float warp_sums[];  // K x warps
  const int warps = (blockDim.x + 31) / 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t units = D / N;
  for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
    const T* g = gy + t * D;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t j = t * K + k;
      const int64_t r = row[j];
      const float wj = w[j];
      float dot = 0.0f;
      for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
        if constexpr (kVec) {
          const Pack<T> pg = load_pack(g, u), po = load_pack(out + r * D, u);
          Pack<T> pd;
#pragma unroll
          for (int i = 0; i < N; ++i) {
            pd.set(i, pg.get(i) * wj);
            dot += pg.get(i) * po.get(i);
          }
          store_pack(grad_out + r * D, u, pd);
        } else {
          const float gv = to_float(g[u]);
          grad_out[r * D + u] = from_float<T>(gv * wj);
          dot += gv * to_float(out[r * D + u]);
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off /= 2) dot += __shfl_down_sync(0xffffffffu, dot, off);
      if (lane == 0) warp_sums[k * warps + warp] = dot;
    }
    __syncthreads();
    for (int64_t k = threadIdx.x; k < K; k += blockDim.x) {
      float sum = 0.0f;
      for (int i = 0; i < warps; ++i) sum += warp_sums[k * warps + i];
      grad_w[t * K + k] = sum;
    }
    __syncthreads();
  }
}

int combine_threads(int64_t units) {
  return static_cast<int>(std::min<int64_t>(kThreads, std::max<int64_t>(32, (units + 31) / 32 * 32)));
}
int combine_blocks(int64_t tokens) { return static_cast<int>(std::min<int64_t>(tokens, 1 << 16)); }

template <typename T>
struct MoeCombineForward {
  static void run(const void* out, const int64_t* row, const float* w, void* y, int64_t T_, int64_t K, int64_t D,
                  bool vec, cudaStream_t stream) {
    const int threads = combine_threads(vec ? D / Pack<T>::kN : D);
    auto* O = static_cast<const T*>(out);
    auto* Y = static_cast<T*>(y);
    if (vec) moe_combine_forward_kernel<T, true><<<combine_blocks(T_), threads, 0, stream>>>(O, row, w, Y, T_, K, D);
    else moe_combine_forward_kernel<T, false><<<combine_blocks(T_), threads, 0, stream>>>(O, row, w, Y, T_, K, D);
  }
};

template <typename T>
struct MoeCombineBackward {
  static void run(const void* gy, const void* out, const int64_t* row, const float* w, void* grad_out, float* grad_w,
                  int64_t T_, int64_t K, int64_t D, bool vec, cudaStream_t stream) {
    const int threads = combine_threads(vec ? D / Pack<T>::kN : D);
    const size_t smem = sizeof(float) * static_cast<size_t>(K) * ((threads + 31) / 32);
    auto* G = static_cast<const T*>(gy);
    auto* O = static_cast<const T*>(out);
    auto* GO = static_cast<T*>(grad_out);
    if (vec)
      moe_combine_backward_kernel<T, true><<<combine_blocks(T_), threads, smem, stream>>>(G, O, row, w, GO, grad_w, T_, K, D);
    else
      moe_combine_backward_kernel<T, false><<<combine_blocks(T_), threads, smem, stream>>>(G, O, row, w, GO, grad_w, T_, K, D);
  }
};

}  // namespace

cudaError_t swiglu_forward(Dtype dtype, const void* a, const void* b, void* out, int64_t n, bool vec,
                           cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch<SwigluForward>(dtype, a, b, out, n, vec, stream);
}

cudaError_t swiglu_backward(Dtype dtype, const void* g, const void* a, const void* b, void* da, void* db,
                            int64_t n, bool vec, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch<SwigluBackward>(dtype, g, a, b, da, db, n, vec, stream);
}

cudaError_t rope(Dtype dtype, const void* x, const float* cis, void* out, const RopeShape& shape, bool inverse,
                 cudaStream_t stream) {
  if (shape.B * shape.S * shape.n * shape.E == 0) return cudaSuccess;
  return dispatch<Rope>(dtype, x, cis, out, shape, inverse, stream);
}

cudaError_t cross_entropy_forward(Dtype dtype, const void* x, int64_t N, int64_t V, int64_t row_stride,
                                  const int64_t* labels, int64_t ignore_index, float* lse, float* loss, bool vec,
                                  cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  return dispatch<CrossEntropyForward>(dtype, x, N, V, row_stride, labels, ignore_index, lse, loss, vec, stream);
}

cudaError_t cross_entropy_backward(Dtype dtype, const void* x, int64_t N, int64_t V, int64_t row_stride,
                                   const int64_t* labels, int64_t ignore_index, const float* lse, const float* g,
                                   void* grad, bool vec, cudaStream_t stream) {
  if (N == 0) return cudaSuccess;
  return dispatch<CrossEntropyBackward>(dtype, x, N, V, row_stride, labels, ignore_index, lse, g, grad, vec, stream);
}

cudaError_t moe_combine_forward(Dtype dtype, const void* out, const int64_t* row, const float* w, void* y, int64_t T,
                                int64_t K, int64_t D, bool vec, cudaStream_t stream) {
  if (T == 0 || D == 0) return cudaSuccess;
  return dispatch<MoeCombineForward>(dtype, out, row, w, y, T, K, D, vec, stream);
}

cudaError_t moe_combine_backward(Dtype dtype, const void* gy, const void* out, const int64_t* row, const float* w,
                                 void* grad_out, float* grad_w, int64_t T, int64_t K, int64_t D, bool vec,
                                 cudaStream_t stream) {
  if (T == 0 || K == 0) return cudaSuccess;
  return dispatch<MoeCombineBackward>(dtype, gy, out, row, w, grad_out, grad_w, T, K, D, vec, stream);
}

}  // namespace titan::nn::cuda_launch
