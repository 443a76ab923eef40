// Multi-head latent attention (DeepSeek-V2/V3) and YaRN RoPE frequencies.
//
// For x (B, S, D), H heads, head dims Cn (qk_nope), Cr (qk_rope), Cv (v), latent ranks Lq, Lkv:
//   q   = wq(x) (H * (Cn + Cr)), or wq_b(q_norm(wq_a(x))) with a query latent of rank Lq
//   kv  = wkv_a(x) (Lkv + Cr): the latent c_kv (Lkv) and one rotary key k_pe (Cr) shared by the heads
//   q_pe, k_pe rotated (RoPE over Cr, pairs interleaved); q = [q_nope, q_pe]
//   [k_nope, v] = wkv_b(kv_norm(c_kv)) per head (Cn + Cv); k = [k_nope, k_pe]
//   out = wo(causal attention of q over k, v), scores scaled by (Cn + Cr)^-1/2 * softmax_scale
// Names: attention.wq.weight, or attention.wq_a.weight, attention.q_norm.weight, attention.wq_b.weight;
// attention.wkv_a.weight, attention.kv_norm.weight, attention.wkv_b.weight, attention.wo.weight
// (torchtitan's). The attention kernels take one head dim: v is padded with zeros to Cn + Cr and the
// padding cut from the output (exact), and the extra scale is applied to q.
#pragma once

#include "titan/nn/layers.h"

namespace titan::nn {

struct MLAOptions {
  int64_t q_lora_rank = 0;  // 0: q projected directly by wq
  int64_t kv_lora_rank = 512;
  int64_t qk_nope_head_dim = 128;
  int64_t qk_rope_head_dim = 64;
  int64_t v_head_dim = 128;
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

// YaRN's frequencies (DeepSeek's form): theta^(-2i/E) for i < E/2, divided by `factor` where the
// wavelength exceeds the original context, kept where it is short, with a linear ramp between the
// dimensions the correction range [beta_fast, beta_slow] gives.
struct YarnScaling {
  double factor = 40;
  int64_t original_seq_len = 4096;
  double beta_fast = 32, beta_slow = 1;
  double mscale = 1.0;  // the softmax scale grows by (0.1 * mscale * ln(factor) + 1)^2
  double softmax_scale() const;
};
at::Tensor yarn_frequencies(int64_t rope_dim, double theta, const YarnScaling& yarn);

class MultiLatentAttentionImpl : public HookedModule {
 public:
  // softmax_scale: multiplies the default (Cn + Cr)^-1/2 (YaRN's mscale^2; 1 without).
  MultiLatentAttentionImpl(int64_t dim, int64_t n_heads, const MLAOptions& options, double norm_eps,
                           double softmax_scale, const at::TensorOptions& opts);
  // cis_SE2: the RoPE table over Cr (S, Cr/2).
  at::Tensor forward(const at::Tensor& x_BSD, const at::Tensor& cis_SE2);
  int64_t n_heads;
  MLAOptions options;
  double softmax_scale;
  Linear wq{nullptr}, wq_a{nullptr}, wq_b{nullptr}, wkv_a{nullptr}, wkv_b{nullptr}, wo{nullptr};
  RMSNorm q_norm{nullptr}, kv_norm{nullptr};
  // As AttentionImpl's: the attention of the rotated q (B, H, S, Cn + Cr) over k, v (v padded to
  // the same dim), replaced by context parallelism.
  std::function<at::Tensor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v)> attend;
  AttentionKernels kernels = causal_attention_kernels();

 private:
  at::Tensor body(const at::Tensor& x_BSD, const at::Tensor& cis_SE2);
};
TORCH_MODULE(MultiLatentAttention);

}  // namespace titan::nn
