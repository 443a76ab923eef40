// Conversions between the element types titan's CUDA kernels store (fp32, bf16, fp16) and the fp32
// they compute in; to the narrow types rounded to nearest, ties to even.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace titan::nn::cuda_launch {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

}  // namespace titan::nn::cuda_launch
