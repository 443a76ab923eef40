#include "titan/nn/fused_kernels.h"

#include <ATen/ATen.h>

#if TITAN_CUDA_KERNELS
#include "titan/nn/cuda/launch.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>
#include <limits>

namespace titan::nn::fused {

namespace {
bool kernel_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }
}  // namespace

bool cross_entropy_shapes(const at::Tensor& logits, const at::Tensor& labels) {
  return logits.dim() == 2 && kernel_dtype(logits.scalar_type()) &&
         (logits.size(1) <= 1 || logits.stride(1) == 1) && logits.size(0) < std::numeric_limits<int32_t>::max() &&
         labels.device() == logits.device() && labels.scalar_type() == at::kLong && labels.dim() == 1 &&
         labels.size(0) == logits.size(0);
}

#if TITAN_CUDA_KERNELS

namespace {

namespace launch = cuda_launch;

launch::Dtype dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return launch::Dtype::kFloat;
    case at::kBFloat16: return launch::Dtype::kBFloat16;
    case at::kHalf: return launch::Dtype::kHalf;
    default: TORCH_CHECK(false, "titan's fused kernels take float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

cudaStream_t stream_of(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

}  // namespace

bool kernels_built() { return true; }

bool swiglu_accepts(const at::Tensor& a, const at::Tensor& b) {
  return a.is_cuda() && b.device() == a.device() && kernel_dtype(a.scalar_type()) &&
         b.scalar_type() == a.scalar_type() && a.sizes() == b.sizes();
}

at::Tensor swiglu_forward(const at::Tensor& a_in, const at::Tensor& b_in) {
  TORCH_CHECK(swiglu_accepts(a_in, b_in), "fused swiglu: unsupported inputs");
  const c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  at::Tensor out = at::empty_like(a, at::MemoryFormat::Contiguous);
  const int64_t bytes = a.numel() * a.element_size();
  const bool vec = bytes % 16 == 0 && aligned16(a.data_ptr()) && aligned16(b.data_ptr()) && aligned16(out.data_ptr());
  C10_CUDA_CHECK(launch::swiglu_forward(dtype_of(a), a.data_ptr(), b.data_ptr(), out.data_ptr(), a.numel(), vec,
                                        stream_of(a)));
  return out;
}

std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& g_in, const at::Tensor& a_in, const at::Tensor& b_in) {
  TORCH_CHECK(swiglu_accepts(a_in, b_in) && swiglu_accepts(g_in, a_in), "fused swiglu backward: unsupported inputs");
  const c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor g = g_in.contiguous(), a = a_in.contiguous(), b = b_in.contiguous();
  at::Tensor da = at::empty_like(a, at::MemoryFormat::Contiguous), db = at::empty_like(a, at::MemoryFormat::Contiguous);
  const int64_t bytes = a.numel() * a.element_size();
  const bool vec = bytes % 16 == 0 && aligned16(g.data_ptr()) && aligned16(a.data_ptr()) && aligned16(b.data_ptr()) &&
                   aligned16(da.data_ptr()) && aligned16(db.data_ptr());
  C10_CUDA_CHECK(launch::swiglu_backward(dtype_of(a), g.data_ptr(), a.data_ptr(), b.data_ptr(), da.data_ptr(),
                                         db.data_ptr(), a.numel(), vec, stream_of(a)));
  return {da, db};
}

bool rope_accepts(const at::Tensor& x, const at::Tensor& cis) {
  return x.is_cuda() && x.dim() == 4 && kernel_dtype(x.scalar_type()) && x.size(3) % 2 == 0 &&
         (x.size(3) <= 1 || x.stride(3) == 1) && cis.device() == x.device() && cis.scalar_type() == at::kComplexFloat &&
         !cis.is_conj() && cis.dim() == 2 && cis.size(0) == x.size(1) && cis.size(1) == x.size(3) / 2;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cis_in, bool inverse) {
  TORCH_CHECK(rope_accepts(x, cis_in), "fused rope: unsupported inputs");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor cis = cis_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const launch::RopeShape shape{x.size(0), x.size(1), x.size(2), x.size(3), x.stride(0), x.stride(1), x.stride(2)};
  C10_CUDA_CHECK(launch::rope(dtype_of(x), x.data_ptr(), reinterpret_cast<const float*>(cis.data_ptr()),
                              out.data_ptr(), shape, inverse, stream_of(x)));
  return out;
}

bool cross_entropy_accepts(const at::Tensor& logits, const at::Tensor& labels) {
  return logits.is_cuda() && cross_entropy_shapes(logits, labels);
}

namespace {

bool rows_vectorizable(const at::Tensor& logits) {
  const int64_t es = logits.element_size();
  return (logits.size(1) * es) % 16 == 0 && (logits.stride(0) * es) % 16 == 0 && aligned16(logits.data_ptr());
}

}  // namespace

std::pair<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits, const at::Tensor& labels_in,
                                                        int64_t ignore_index) {
  TORCH_CHECK(cross_entropy_accepts(logits, labels_in), "fused cross-entropy: unsupported inputs");
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor labels = labels_in.contiguous();
  const int64_t N = logits.size(0), V = logits.size(1);
  const auto f32 = logits.options().dtype(at::kFloat);
  at::Tensor lse = at::empty({N}, f32), loss = at::empty({N}, f32);
  C10_CUDA_CHECK(launch::cross_entropy_forward(dtype_of(logits), logits.data_ptr(), N, V, logits.stride(0),
                                               labels.data_ptr<int64_t>(), ignore_index, lse.data_ptr<float>(),
                                               loss.data_ptr<float>(), rows_vectorizable(logits), stream_of(logits)));
  return {lse, loss};
}

at::Tensor cross_entropy_backward(const at::Tensor& logits, const at::Tensor& labels_in, const at::Tensor& lse_in,
                                  const at::Tensor& g_in, int64_t ignore_index) {
  TORCH_CHECK(cross_entropy_accepts(logits, labels_in), "fused cross-entropy backward: unsupported inputs");
  TORCH_CHECK(g_in.numel() == 1 && g_in.device() == logits.device(), "fused cross-entropy backward: g must be one value on ",
              logits.device());
  const c10::cuda::CUDAGuard guard(logits.device());
  const at::Tensor labels = labels_in.contiguous(), lse = lse_in.to(at::kFloat).contiguous();
  const at::Tensor g = g_in.to(at::kFloat).contiguous();
  const int64_t N = logits.size(0), V = logits.size(1);
  at::Tensor grad = at::empty({N, V}, logits.options().memory_format(at::MemoryFormat::Contiguous));
  const bool vec = rows_vectorizable(logits) && aligned16(grad.data_ptr());
  C10_CUDA_CHECK(launch::cross_entropy_backward(dtype_of(logits), logits.data_ptr(), N, V, logits.stride(0),
                                                labels.data_ptr<int64_t>(), ignore_index, lse.data_ptr<float>(),
                                                g.data_ptr<float>(), grad.data_ptr(), vec, stream_of(logits)));
  return grad;
}

namespace {

// t's (rows, columns) and their strides. A 1-D tensor is rows of 32 where its length allows (the
// kernel's tiles are 32 x 32), else one row.
struct Matrix {
  int64_t R, C, sr, sc;
};
Matrix matrix_of(const at::Tensor& t) {
  if (t.dim() == 2) return {t.size(0), t.size(1), t.stride(0), t.stride(1)};
  const int64_t n = t.size(0), s = t.stride(0);
  if (n % 32 == 0) return {n / 32, 32, 32 * s, s};
  return {1, n, n * s, s};
}

}  // namespace

bool float8_cast_accepts(const at::Tensor& t, const at::Tensor& scale) {
  if (!t.is_cuda() || (t.dim() != 1 && t.dim() != 2) || !kernel_dtype(t.scalar_type()) ||
      scale.device() != t.device() || scale.scalar_type() != at::kFloat)
    return false;
  const Matrix m = matrix_of(t);
  const int64_t n = scale.numel();
  if (scale.dim() > t.dim()) return false;  // (ATen would broadcast t to the scale's rank)
  if (n == 1) return true;
  if (t.dim() == 1) return false;
  // One per row: (R, 1); one per column: (1, C) (a 1-D scale would broadcast along the columns).
  return scale.dim() == 2 && ((scale.size(0) == m.R && scale.size(1) == 1) || (scale.size(0) == 1 && scale.size(1) == m.C));
}

at::Tensor float8_cast(const at::Tensor& t, const at::Tensor& scale_in, at::ScalarType fp8, bool column_major) {
  TORCH_CHECK(float8_cast_accepts(t, scale_in), "fused float8 cast: unsupported inputs");
  TORCH_CHECK(fp8 == at::kFloat8_e4m3fn || fp8 == at::kFloat8_e5m2, "fused float8 cast: e4m3fn or e5m2, got ", fp8);
  const c10::cuda::CUDAGuard guard(t.device());
  const Matrix m = matrix_of(t);
  const at::Tensor scale = scale_in.contiguous();
  launch::Float8Scale mode = launch::Float8Scale::kOne;
  if (scale.numel() != 1)
    mode = scale.dim() == 2 && scale.size(0) == 1 ? launch::Float8Scale::kPerColumn : launch::Float8Scale::kPerRow;
  at::Tensor out = column_major && t.dim() == 2 ? at::empty({m.C, m.R}, t.options().dtype(fp8)).t()
                                                : at::empty(t.sizes(), t.options().dtype(fp8));
  const bool e4m3 = fp8 == at::kFloat8_e4m3fn;
  if (t.dim() == 1 && t.numel() > 32 && t.numel() % 32 != 0) {
    // A 1-D tensor of another length: its rows of 32, then the rest as one row.
    const int64_t n = t.numel(), body = n / 32 * 32, s = t.stride(0);
    C10_CUDA_CHECK(launch::float8_cast(dtype_of(t), t.data_ptr(), body / 32, 32, 32 * s, s, scale.data_ptr<float>(),
                                       mode, e4m3, out.data_ptr(), false, stream_of(t)));
    const at::Tensor rest = t.narrow(0, body, n - body);
    C10_CUDA_CHECK(launch::float8_cast(dtype_of(t), rest.data_ptr(), 1, n - body, n * s, s, scale.data_ptr<float>(),
                                       mode, e4m3, static_cast<uint8_t*>(out.data_ptr()) + body, false, stream_of(t)));
    return out;
  }
  C10_CUDA_CHECK(launch::float8_cast(dtype_of(t), t.data_ptr(), m.R, m.C, m.sr, m.sc, scale.data_ptr<float>(), mode,
                                     e4m3, out.data_ptr(), column_major && t.dim() == 2, stream_of(t)));
  return out;
}

bool moe_combine_accepts(const at::Tensor& out, const at::Tensor& row, const at::Tensor& w, int64_t K) {
  // K <= 1024: the backward's K per-warp sums fit the default 48 KiB of shared memory (8 warps).
  return K > 0 && K <= 1024 && row.numel() % K == 0 && out.is_cuda() && out.dim() == 2 &&
         kernel_dtype(out.scalar_type()) && row.device() == out.device() && row.scalar_type() == at::kLong &&
         row.dim() == 1 &&
         (!w.defined() || (w.device() == out.device() && w.scalar_type() == at::kFloat && w.numel() == row.numel()));
}

namespace {
bool rows_of_16_bytes(const at::Tensor& t) {
  return (t.size(1) * static_cast<int64_t>(t.element_size())) % 16 == 0 && aligned16(t.data_ptr());
}
}  // namespace

at::Tensor moe_combine_forward(const at::Tensor& out_in, const at::Tensor& row_in, const at::Tensor& w_in, int64_t K) {
  TORCH_CHECK(moe_combine_accepts(out_in, row_in, w_in, K), "fused MoE combine: unsupported inputs");
  const c10::cuda::CUDAGuard guard(out_in.device());
  const at::Tensor out = out_in.contiguous(), row = row_in.contiguous();
  const at::Tensor w = w_in.defined() ? w_in.contiguous() : w_in;
  const int64_t T = row.numel() / K, D = out.size(1);
  at::Tensor y = at::empty({T, D}, out.options());
  const bool vec = rows_of_16_bytes(out) && aligned16(y.data_ptr());
  C10_CUDA_CHECK(launch::moe_combine_forward(dtype_of(out), out.data_ptr(), row.data_ptr<int64_t>(),
                                             w.defined() ? w.data_ptr<float>() : nullptr, y.data_ptr(), T, K, D, vec,
                                             stream_of(out)));
  return y;
}

std::pair<at::Tensor, at::Tensor> moe_combine_backward(const at::Tensor& gy_in, const at::Tensor& out_in,
                                                       const at::Tensor& row_in, const at::Tensor& w_in, int64_t K) {
  TORCH_CHECK(moe_combine_accepts(out_in, row_in, w_in, K) && w_in.defined() && gy_in.device() == out_in.device() &&
                  gy_in.scalar_type() == out_in.scalar_type() && gy_in.dim() == 2 &&
                  gy_in.size(0) * K == row_in.numel() && gy_in.size(1) == out_in.size(1),
              "fused MoE combine backward: unsupported inputs");
  const c10::cuda::CUDAGuard guard(out_in.device());
  const at::Tensor gy = gy_in.contiguous(), out = out_in.contiguous(), row = row_in.contiguous(), w = w_in.contiguous();
  const int64_t T = gy.size(0), D = out.size(1);
  // Every row is written when row holds each of out's rows once (the MoE layer's permutation).
  at::Tensor grad_out = out.size(0) == row.numel() ? at::empty_like(out) : at::zeros_like(out);
  at::Tensor grad_w = at::empty({row.numel()}, w.options());
  const bool vec = rows_of_16_bytes(out) && rows_of_16_bytes(gy) && aligned16(grad_out.data_ptr());
  C10_CUDA_CHECK(launch::moe_combine_backward(dtype_of(out), gy.data_ptr(), out.data_ptr(), row.data_ptr<int64_t>(),
                                              w.data_ptr<float>(), grad_out.data_ptr(), grad_w.data_ptr<float>(), T, K,
                                              D, vec, stream_of(out)));
  return {grad_out, grad_w};
}

bool init_normal(at::Tensor& flat, int64_t first, uint32_t k0, uint32_t k1, float mean, float std, bool truncated,
                 float a_in, float b_in) {
  if (!flat.is_cuda() || !flat.is_contiguous() || !kernel_dtype(flat.scalar_type())) return false;
  const c10::cuda::CUDAGuard guard(flat.device());
  C10_CUDA_CHECK(launch::init_normal(dtype_of(flat), flat.data_ptr(), first, flat.numel(), k0, k1, mean, std,
                                     truncated, a_in, b_in, stream_of(flat)));
  return true;
}

#else  // a CPU-only libtorch: no kernels, and no tensor is ever accepted

bool kernels_built() { return false; }
bool swiglu_accepts(const at::Tensor&, const at::Tensor&) { return false; }
bool rope_accepts(const at::Tensor&, const at::Tensor&) { return false; }
bool cross_entropy_accepts(const at::Tensor&, const at::Tensor&) { return false; }
bool float8_cast_accepts(const at::Tensor&, const at::Tensor&) { return false; }
bool moe_combine_accepts(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) { return false; }
bool init_normal(at::Tensor&, int64_t, uint32_t, uint32_t, float, float, bool, float, float) { return false; }

namespace {
[[noreturn]] void not_built(const char* what) {
  TORCH_CHECK(false, what, ": this titan was built against a libtorch without CUDA, so it has no fused CUDA kernels");
}
}  // namespace

at::Tensor swiglu_forward(const at::Tensor&, const at::Tensor&) { not_built("fused swiglu"); }
std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  not_built("fused swiglu backward");
}
at::Tensor rope(const at::Tensor&, const at::Tensor&, bool) { not_built("fused rope"); }
at::Tensor float8_cast(const at::Tensor&, const at::Tensor&, at::ScalarType, bool) { not_built("fused float8 cast"); }
at::Tensor moe_combine_forward(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  not_built("fused MoE combine");
}
std::pair<at::Tensor, at::Tensor> moe_combine_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                       const at::Tensor&, int64_t) {
  not_built("fused MoE combine backward");
}
std::pair<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor&, const at::Tensor&, int64_t) {
  not_built("fused cross-entropy");
}
at::Tensor cross_entropy_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  not_built("fused cross-entropy backward");
}

#endif

}  // namespace titan::nn::fused
