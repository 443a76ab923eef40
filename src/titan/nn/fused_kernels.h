// titan's fused CUDA kernels behind ATen tensors: SwiGLU, RoPE and the cross-entropy of logit rows,
// each one pass over its tensors with fp32 arithmetic (fused_math.h) in place of ATen's several
// elementwise passes and fp32 temporaries. The layers (layers.cpp, loss.cpp) call them for CUDA
// tensors they accept (`*_accepts`) and keep their ATen formulation otherwise, and on the CPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace titan::nn::fused {

// Whether this build has the kernels (a CUDA build of libtorch).
bool kernels_built();

// CUDA tensors of one device and one dtype of float32, bfloat16 or float16, with the same shape.
bool swiglu_accepts(const at::Tensor& a, const at::Tensor& b);
at::Tensor swiglu_forward(const at::Tensor& a, const at::Tensor& b);
// (grad of a, grad of b) for the upstream gradient g (a's shape; made contiguous when it is not).
std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& g, const at::Tensor& a, const at::Tensor& b);

// x (B, S, n, E) on CUDA (float32, bfloat16 or float16, last dimension contiguous, E even) and cis
// (S, E/2) complex64 on x's device: x's pairs times cis, or times its conjugate when `inverse`.
// Returns a contiguous tensor of x's dtype.
bool rope_accepts(const at::Tensor& x, const at::Tensor& cis);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cis, bool inverse);

// logits (N, V) on CUDA (float32, bfloat16 or float16, rows contiguous) and labels (N) int64 on
// the same device. Forward: (lse (N) fp32, loss (N) fp32: lse - logits[label], 0 on ignored rows).
// Backward: g * (softmax - onehot(label)) in the logits' dtype, 0 on ignored rows; g is an fp32
// scalar on the device (no host synchronization). A label outside [0, V) (not ignore_index) gives its
// row a NaN loss and NaN gradients, caught by the NaN policy (ATen's gather would stop the process
// with a device-side assertion instead).
bool cross_entropy_accepts(const at::Tensor& logits, const at::Tensor& labels);
// The same conditions but the device (labels on the logits' device): what a meta tensor standing for
// a CUDA one must meet to count as the kernels allocate (titan estimate's dry run).
bool cross_entropy_shapes(const at::Tensor& logits, const at::Tensor& labels);
std::pair<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits, const at::Tensor& labels,
                                                        int64_t ignore_index);
at::Tensor cross_entropy_backward(const at::Tensor& logits, const at::Tensor& labels, const at::Tensor& lse,
                                  const at::Tensor& g, int64_t ignore_index);

// t (R, C) or (n) on CUDA (float32, bfloat16 or float16, any strides) and `scale` fp32 on its
// device: one value, one per row (R, 1) or one per column (1, C). Returns
// float8(clamp(t * scale, -max, max)) in `fp8` (Float8_e4m3fn or Float8_e5m2), to nearest even, in
// one pass: t's shape, row-major, or column-major when `column_major` (its transpose contiguous:
// cuBLAS's layout for a matmul's second operand), with no fp32 temporaries.
bool float8_cast_accepts(const at::Tensor& t, const at::Tensor& scale);
at::Tensor float8_cast(const at::Tensor& t, const at::Tensor& scale, at::ScalarType fp8, bool column_major);

// The MoE layer's combine (moe.cpp): out (rows, D) on CUDA (float32, bfloat16 or float16), row
// (T * K, K at most 1024) int64 and w (T * K) fp32 on its device, or w undefined for weights of 1.
// Forward: y (T, D), y[t] = sum over k of round(out[row[t * K + k]] * w[t * K + k]) (fp32 products
// rounded to out's dtype, summed in fp32 in the order of k, rounded once), no atomics. Backward (w
// defined; row names each row of out at most once, as the layer's permutation does): the gradient of
// out (row[j] gets round(gy[t] * w[j]); rows row does not name are zero) and of w (fp32, the dot
// product of gy[t] and out[row[j]]).
bool moe_combine_accepts(const at::Tensor& out, const at::Tensor& row, const at::Tensor& w, int64_t K);
at::Tensor moe_combine_forward(const at::Tensor& out, const at::Tensor& row, const at::Tensor& w, int64_t K);
std::pair<at::Tensor, at::Tensor> moe_combine_backward(const at::Tensor& gy, const at::Tensor& out,
                                                       const at::Tensor& row, const at::Tensor& w, int64_t K);

// Parameter initialization on the GPU (init.cpp): `flat`, a contiguous CUDA tensor of float32,
// bfloat16 or float16, gets elements [first, first + flat.numel()) of the normal (or, when
// `truncated`, normal redrawn until inside [a_in, b_in]) that init.cpp's CPU generator draws with
// key (k0, k1), bit for bit. False, with nothing written, for a tensor the kernel does not take.
bool init_normal(at::Tensor& flat, int64_t first, uint32_t k0, uint32_t k1, float mean, float std, bool truncated,
                 float a_in, float b_in);

}  // namespace titan::nn::fused
