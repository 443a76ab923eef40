// TITAN_HD: a function compiled for the host and, under nvcc, for CUDA devices too (the arithmetic
// shared by titan's CUDA kernels and the CPU code or tests that check them).
#pragma once

#if defined(__CUDACC__)
#define TITAN_HD __host__ __device__ __forceinline__
#else
#define TITAN_HD inline
#endif
