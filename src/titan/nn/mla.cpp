#include "titan/nn/mla.h"

#include "titan/common/error.h"
#include "titan/nn/activation_checkpoint.h"
#include "titan/nn/float8.h"

#include <ATen/ATen.h>

#include <cmath>

namespace titan::nn {

double YarnScaling::softmax_scale() const {
  if (factor <= 1.0) return 1.0;
  const double m = 0.1 * mscale * std::log(factor) + 1.0;
  return m * m;
}

at::Tensor yarn_frequencies(int64_t rope_dim, double theta, const YarnScaling& y) {
  const at::Tensor freqs = rope_frequencies(rope_dim, theta, std::nullopt);
  if (y.factor <= 1.0) return freqs;
  // The dimension whose wavelength spans `rotations` turns over the original context.
  auto correction_dim = [&](double rotations) {
    return static_cast<double>(rope_dim) * std::log(static_cast<double>(y.original_seq_len) / (rotations * 2 * M_PI)) /
           (2 * std::log(theta));
  };
  const double last = static_cast<double>(rope_dim - 1);
  const double low = std::max(std::floor(correction_dim(y.beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(y.beta_slow)), last);
  if (low == high) high += 0.001;
  const at::Tensor ramp = ((at::arange(rope_dim / 2, at::kFloat) - low) / (high - low)).clamp(0, 1);
  return freqs / y.factor * ramp + freqs * (1 - ramp);
}

MultiLatentAttentionImpl::MultiLatentAttentionImpl(int64_t dim, int64_t n_heads_, const MLAOptions& o, double norm_eps,
                                                   double softmax_scale_, const at::TensorOptions& opts)
    : n_heads(n_heads_), options(o), softmax_scale(softmax_scale_) {
  TITAN_USER_CHECK(o.kv_lora_rank > 0 && o.qk_nope_head_dim >= 0 && o.qk_rope_head_dim > 0 &&
                       o.qk_rope_head_dim % 2 == 0 && o.v_head_dim > 0 && o.q_lora_rank >= 0 &&
                       o.v_head_dim <= o.qk_head_dim(),
                   "model: multi-head latent attention needs kv_lora_rank > 0, an even qk_rope_head_dim > 0, "
                   "qk_nope_head_dim >= 0, q_lora_rank >= 0 and 0 < v_head_dim <= qk_nope_head_dim + qk_rope_head_dim");
  const int64_t qk = o.qk_head_dim();
  if (o.q_lora_rank == 0) {
    wq = register_module("wq", Linear(dim, n_heads * qk, opts));
  } else {
    wq_a = register_module("wq_a", Linear(dim, o.q_lora_rank, opts));
    q_norm = register_module("q_norm", RMSNorm(o.q_lora_rank, norm_eps, opts));
    wq_b = register_module("wq_b", Linear(o.q_lora_rank, n_heads * qk, opts));
  }
  wkv_a = register_module("wkv_a", Linear(dim, o.kv_lora_rank + o.qk_rope_head_dim, opts));
  kv_norm = register_module("kv_norm", RMSNorm(o.kv_lora_rank, norm_eps, opts));
  wkv_b = register_module("wkv_b", Linear(o.kv_lora_rank, n_heads * (o.qk_nope_head_dim + o.v_head_dim), opts));
  wo = register_module("wo", Linear(n_heads * o.v_head_dim, dim, opts));
}

at::Tensor MultiLatentAttentionImpl::forward(const at::Tensor& x_BSD, const at::Tensor& cis_SE2) {
  return with_hooks({x_BSD, cis_SE2}, [this](const std::vector<at::Tensor>& in) { return body(in[0], in[1]); });
}

at::Tensor MultiLatentAttentionImpl::body(const at::Tensor& x_BSD, const at::Tensor& cis_SE2) {
  const auto B = x_BSD.size(0), S = x_BSD.size(1);
  const int64_t Cn = options.qk_nope_head_dim, Cr = options.qk_rope_head_dim, Cv = options.v_head_dim;
  const int64_t qk = Cn + Cr;
  at::Tensor q_flat, kv;
  {
    Float8SharedInputs shared_casts;  // the layers on x (wq or wq_a, and wkv_a) in float8 cast it once
    q_flat = wq ? wq(x_BSD) : wq_b(q_norm(wq_a(x_BSD)));
    kv = wkv_a(x_BSD);
  }
  const at::Tensor q_BSHC = q_flat.view({B, S, -1, qk});
  const int64_t H = q_BSHC.size(2);
  const at::Tensor q_pe = apply_rope(q_BSHC.narrow(-1, Cn, Cr), cis_SE2);
  const at::Tensor k_pe = apply_rope(kv.narrow(-1, options.kv_lora_rank, Cr).unsqueeze(2), cis_SE2);  // (B, S, 1, Cr)
  const at::Tensor kv_BSHC = wkv_b(kv_norm(kv.narrow(-1, 0, options.kv_lora_rank))).view({B, S, H, Cn + Cv});
  at::Tensor q = at::cat({q_BSHC.narrow(-1, 0, Cn), q_pe}, -1);
  if (softmax_scale != 1.0) q = q * softmax_scale;
  const at::Tensor k = at::cat({kv_BSHC.narrow(-1, 0, Cn), k_pe.expand({B, S, H, Cr})}, -1);
  at::Tensor v = kv_BSHC.narrow(-1, Cn, Cv);
  if (Cv < qk) v = at::constant_pad_nd(v, {0, qk - Cv});
  at::Tensor out_BHSC = saveable_attention(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
      [this](const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_) {
        return attend ? attend(q_, k_, v_) : causal_attention(q_, k_, v_);
      },
      kernels);
  if (Cv < qk) out_BHSC = out_BHSC.narrow(-1, 0, Cv);
  return wo(out_BHSC.transpose(1, 2).contiguous().view({B, S, H * Cv}));
}

}  // namespace titan::nn
