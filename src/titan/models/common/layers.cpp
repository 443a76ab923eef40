#include "titan/models/common/layers.h"

#include "titan/common/tensor_storage.h"

#include <ATen/ATen.h>

#include <cmath>

namespace titan::nn {

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, const at::TensorOptions& opts) {
  weight = register_parameter("weight", new_parameter({out_features, in_features}, opts));
}

at::Tensor LinearImpl::forward(const at::Tensor& x) { return at::linear(x, weight); }

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t dim, const at::TensorOptions& opts) {
  weight = register_parameter("weight", new_parameter({num_embeddings, dim}, opts));
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& tokens_BS) { return at::embedding(weight, tokens_BS); }

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_, const at::TensorOptions& opts) : eps(eps_) {
  weight = register_parameter("weight", new_parameter({dim}, opts));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return at::rms_norm(x, {weight.size(0)}, weight, eps);
}

void RMSNormImpl::reset_parameters() {
  if (!has_storage(weight)) return;
  at::NoGradGuard no_grad;
  weight.fill_(1.0);
}

at::Tensor rope_frequencies(int64_t head_dim, double theta, const std::optional<RopeScaling>& s) {
  // freqs_i = theta^(-2i/E), computed in fp32 like the reference implementation.
  at::Tensor exponents = at::arange(0, head_dim, 2, at::kLong).slice(0, 0, head_dim / 2).to(at::kFloat) /
                         static_cast<double>(head_dim);
  at::Tensor freqs = 1.0 / at::pow(theta, exponents);
  if (!s) return freqs;
  // Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
  const double low_wavelen = s->original_max_position_embeddings / s->low_freq_factor;
  const double high_wavelen = s->original_max_position_embeddings / s->high_freq_factor;
  at::Tensor wavelen = 2 * M_PI / freqs;
  at::Tensor scaled = at::where(wavelen > low_wavelen, freqs / s->factor, freqs);
  at::Tensor smooth = (s->original_max_position_embeddings / wavelen - s->low_freq_factor) /
                      (s->high_freq_factor - s->low_freq_factor);
  at::Tensor is_medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return at::where(is_medium, (1 - smooth) * scaled / s->factor + smooth * scaled, scaled);
}

at::Tensor apply_rope(const at::Tensor& x_BSnE, const at::Tensor& cis_SE2) {
  const auto B = x_BSnE.size(0), S = x_BSnE.size(1), n = x_BSnE.size(2), E = x_BSnE.size(3);
  // Each head vector is E/2 complex numbers (re, im) rotated by cos + i sin: one complex multiply
  // in fp32 (fewer kernels and temporaries than the real-valued formulation).
  at::Tensor x_c = at::view_as_complex(x_BSnE.to(at::kFloat).reshape({B, S, n, E / 2, 2}));
  return at::view_as_real(x_c * cis_SE2.view({1, S, 1, E / 2})).flatten(3).to(x_BSnE.scalar_type());
}

AttentionImpl::AttentionImpl(int64_t dim, int64_t n_heads_, int64_t n_kv_heads_, const at::TensorOptions& opts)
    : n_heads(n_heads_), n_kv_heads(n_kv_heads_), head_dim(dim / n_heads_) {
  wq = register_module("wq", Linear(dim, n_heads * head_dim, opts));
  wk = register_module("wk", Linear(dim, n_kv_heads * head_dim, opts));
  wv = register_module("wv", Linear(dim, n_kv_heads * head_dim, opts));
  wo = register_module("wo", Linear(n_heads * head_dim, dim, opts));
}

at::Tensor AttentionImpl::forward(const at::Tensor& x_BSD, const at::Tensor& cis_SE2) {
  const auto B = x_BSD.size(0), S = x_BSD.size(1);
  // Heads are inferred (-1) so that a tensor-parallel shard of the projections works unchanged.
  at::Tensor q_BSHE = apply_rope(wq(x_BSD).view({B, S, -1, head_dim}), cis_SE2);
  at::Tensor k_BSKE = apply_rope(wk(x_BSD).view({B, S, -1, head_dim}), cis_SE2);
  at::Tensor v_BSKE = wv(x_BSD).view({B, S, -1, head_dim});
  const auto H = q_BSHE.size(2), K = k_BSKE.size(2);
  if (H != K) {  // grouped-query attention: each key/value head serves H/K query heads
    k_BSKE = k_BSKE.unsqueeze(3).expand({B, S, K, H / K, head_dim}).reshape({B, S, H, head_dim});
    v_BSKE = v_BSKE.unsqueeze(3).expand({B, S, K, H / K, head_dim}).reshape({B, S, H, head_dim});
  }
  at::Tensor out_BHSE = at::scaled_dot_product_attention(q_BSHE.transpose(1, 2), k_BSKE.transpose(1, 2),
                                                         v_BSKE.transpose(1, 2), /*attn_mask=*/{},
                                                         /*dropout_p=*/0.0, /*is_causal=*/true);
  return wo(out_BHSE.transpose(1, 2).contiguous().view({B, S, -1}));
}

FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t hidden_dim, const at::TensorOptions& opts) {
  w1 = register_module("w1", Linear(dim, hidden_dim, opts));
  w2 = register_module("w2", Linear(hidden_dim, dim, opts));
  w3 = register_module("w3", Linear(dim, hidden_dim, opts));
}

at::Tensor FeedForwardImpl::forward(const at::Tensor& x_BSD) {
  return w2(at::silu(w1(x_BSD)) * w3(x_BSD));
}

}  // namespace titan::nn
