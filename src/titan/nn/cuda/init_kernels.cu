// The initial values of parameters generated on the GPU: init_math.h's one-element functions, whose
// operations are each rounded on their own (the __f*_rn intrinsics), so every element has the bits
// the CPU kernel gives it. One thread per Philox block: the four elements of its words, 16 apart.
#include "titan/nn/cuda/convert.cuh"
#include "titan/nn/cuda/launch.h"
#include "titan/nn/init_math.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace titan::nn::cuda_launch {
namespace {

template <typename T>
__global__ void init_normal_kernel(T* out, int64_t first, int64_t n, uint32_t k0, uint32_t k1, float mean, float std,
                                   bool truncated, float a_in, float b_in, int64_t first_group, int64_t blocks) {
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < blocks;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t group = first_group + t / 16;
    const uint32_t j = static_cast<uint32_t>(t % 16);
    const init::math::Words w = init::math::philox(static_cast<uint64_t>(group) * 16 + j, 0, k0, k1);
#pragma unroll
    for (uint32_t word = 0; word < 4; ++word) {
      const int64_t e = group * 64 + 16 * word + j;
      if (e < first || e >= first + n) continue;
      float v = word < 2 ? init::math::box_muller(w.w[0], w.w[1], word == 1, mean, std)
                         : init::math::box_muller(w.w[2], w.w[3], word == 3, mean, std);
      if (truncated && (v < a_in || v > b_in)) v = init::math::truncated_at(e, k0, k1, mean, std, a_in, b_in);
      out[e - first] = from_float<T>(v);
    }
  }
}

template <typename T>
void launch(void* out, int64_t first, int64_t n, uint32_t k0, uint32_t k1, float mean, float std, bool truncated,
            float a_in, float b_in, cudaStream_t stream) {
  const int64_t first_group = first / 64, last_group = (first + n - 1) / 64;
  const int64_t blocks = (last_group - first_group + 1) * 16;
  constexpr int kThreads = 256;
  const int grid = static_cast<int>(std::min<int64_t>((blocks + kThreads - 1) / kThreads, 1 << 16));
  init_normal_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<T*>(out), first, n, k0, k1, mean, std, truncated,
                                                       a_in, b_in, first_group, blocks);
}

}  // namespace

cudaError_t init_normal(Dtype dtype, void* out, int64_t first, int64_t n, uint32_t k0, uint32_t k1, float mean,
                        float std, bool truncated, float a_in, float b_in, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  switch (dtype) {
    case Dtype::kFloat: launch<float>(out, first, n, k0, k1, mean, std, truncated, a_in, b_in, stream); break;
    case Dtype::kBFloat16: launch<__nv_bfloat16>(out, first, n, k0, k1, mean, std, truncated, a_in, b_in, stream); break;
    case Dtype::kHalf: launch<__half>(out, first, n, k0, k1, mean, std, truncated, a_in, b_in, stream); break;
  }
  return cudaGetLastError();
}

}  // namespace titan::nn::cuda_launch
