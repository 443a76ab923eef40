#include "titan/nn/layers.h"

#include "titan/common/autocast.h"
#include "titan/common/tensor_storage.h"
#include "titan/nn/activation_checkpoint.h"
#include "titan/nn/float8.h"
#include "titan/nn/fused_kernels.h"

#include <ATen/ATen.h>
#include <ATen/SDPBackend.h>
#include <ATen/autocast_mode.h>
#include <torch/autograd.h>

#include <cmath>

namespace titan::nn {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ---------------------------------------------------------------------------------------------
// Autograd functions that save less than their ATen formulations (see the header and docs/memory.md).
// Their forward passes compute what the ATen formulation computes, in the same order, so outputs
// are unchanged; backward passes are the same formulas, written out.
namespace {

// y = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps), all in fp32, rounded once to out_dtype.
// ATen's CPU rms_norm (a composite) would save an fp32 copy of x and the fp32 x * rstd.
// On CUDA both passes are ATen's fused RMSNorm kernels (one pass each, as torch.nn.RMSNorm runs
// there), on the fp32 x: the composite below costs six broadcast elementwise passes and three
// reductions per norm, about 5% of a 1B model's step on an H200 (bench/gpu). Same values, same
// saved tensors (x, weight and the fp32 rstd). When x, the weight and the output share one dtype,
// the kernels take them directly (they compute in fp32 internally): no fp32 copies of x or y.
struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps,
                            at::ScalarType out_dtype) {
    ctx->save_for_backward({x, weight});
    if (x.is_cuda() && weight.scalar_type() == x.scalar_type() && out_dtype == x.scalar_type()) {
      // One dtype throughout (bf16 under FSDP's mixed precision): the kernel reads x and the weight
      // as they are, computes in fp32 and rounds y once, as on the fp32 copies, without the copies.
      auto [y, rstd] = at::_fused_rms_norm(x, {x.size(-1)}, weight, eps);
      ctx->saved_data["rstd"] = rstd;
      return y;
    }
    const at::Tensor x_f = x.to(at::kFloat);  // x itself when x is fp32
    if (x.is_cuda()) {
      auto [y, rstd] = at::_fused_rms_norm(x_f, {x.size(-1)}, weight.to(at::kFloat), eps);
      ctx->saved_data["rstd"] = rstd;
      return y.to(out_dtype);
    }
    at::Tensor rstd = at::rsqrt(at::pow(x_f, 2).mean(-1, /*keepdim=*/true).add_(eps));  // (..., 1)
    ctx->saved_data["rstd"] = rstd;
    return (x_f * rstd).mul_(weight).to(out_dtype);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1];
    const at::Tensor rstd = ctx->saved_data["rstd"].toTensor();
    if (x.is_cuda() && weight.scalar_type() == x.scalar_type() && grads[0].scalar_type() == x.scalar_type()) {
      auto [grad_x, grad_w] = at::_fused_rms_norm_backward(grads[0], x, {x.size(-1)}, rstd, weight,
                                                           {ctx->needs_input_grad(0), ctx->needs_input_grad(1)});
      return {grad_x, grad_w, at::Tensor(), at::Tensor()};
    }
    if (x.is_cuda()) {
      auto [grad_x, grad_w] = at::_fused_rms_norm_backward(
          grads[0].to(at::kFloat), x.to(at::kFloat), {x.size(-1)}, rstd, weight.to(at::kFloat),
          {ctx->needs_input_grad(0), ctx->needs_input_grad(1)});
      return {grad_x.defined() ? grad_x.to(x.scalar_type()) : grad_x,
              grad_w.defined() ? grad_w.to(weight.scalar_type()) : grad_w, at::Tensor(), at::Tensor()};
    }
    const at::Tensor x_hat = x.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true).mul_(rstd);
    const at::Tensor g = grads[0].to(at::kFloat);
    at::Tensor grad_weight;
    if (ctx->needs_input_grad(1))
      grad_weight = (g * x_hat).reshape({-1, x.size(-1)}).sum(0).to(weight.scalar_type());
    at::Tensor grad_x;
    if (ctx->needs_input_grad(0)) {
      // d/dx of x_hat * w: rstd * (g w - x_hat * mean(g w x_hat)).
      at::Tensor gw = g * weight;
      at::Tensor dot = (gw * x_hat).mean(-1, /*keepdim=*/true);
      grad_x = gw.sub_(x_hat * dot).mul_(rstd).to(x.scalar_type());
    }
    return {grad_x, grad_weight, at::Tensor(), at::Tensor()};
  }
};

// x * cis (x * conj(cis) when `inverse`) in fp32, returned in x's dtype: on CUDA one pass of the
// fused kernel; otherwise on one fp32 copy of x (rotated in place).
at::Tensor rotate(const at::Tensor& x_BSnE, const at::Tensor& cis_SE2, bool inverse) {
  if (fused::rope_accepts(x_BSnE, cis_SE2)) return fused::rope(x_BSnE, cis_SE2, inverse);
  const auto B = x_BSnE.size(0), S = x_BSnE.size(1), n = x_BSnE.size(2), E = x_BSnE.size(3);
  at::Tensor x_f = x_BSnE.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
  at::view_as_complex(x_f.view({B, S, n, E / 2, 2})).mul_((inverse ? cis_SE2.conj() : cis_SE2).view({1, S, 1, E / 2}));
  return x_f.to(x_BSnE.scalar_type());
}

// RoPE is a rotation: its backward is the inverse rotation (by the conjugate), which needs only the
// table. (A complex multiply by a constant saves no input in ATen either; this one also keeps a single
// fp32 temporary instead of three.)
struct RopeFunction : public torch::autograd::Function<RopeFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x_BSnE, const at::Tensor& cis_SE2) {
    ctx->saved_data["cis"] = cis_SE2;
    return rotate(x_BSnE, cis_SE2, /*inverse=*/false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {rotate(grads[0], ctx->saved_data["cis"].toTensor(), /*inverse=*/true), at::Tensor()};
  }
};

// silu(h1) * h3. ATen's autograd would also save silu(h1), a fourth (B, S, F) tensor per block.
// On CUDA each pass is one fused kernel (fp32 arithmetic, rounded once): ATen's formulation is
// two passes forward and four backward (bench/gpu).
struct SwiGluFunction : public torch::autograd::Function<SwiGluFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h1, const at::Tensor& h3) {
    ctx->save_for_backward({h1, h3});
    if (fused::swiglu_accepts(h1, h3)) return fused::swiglu_forward(h1, h3);
    return at::silu(h1) * h3;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &h1 = saved[0], &h3 = saved[1], &g = grads[0];
    if (fused::swiglu_accepts(h1, h3) && fused::swiglu_accepts(g, h1)) {
      auto [grad_h1, grad_h3] = fused::swiglu_backward(g, h1, h3);
      return {ctx->needs_input_grad(0) ? grad_h1 : at::Tensor(), ctx->needs_input_grad(1) ? grad_h3 : at::Tensor()};
    }
    // The products and the order of ATen's mul and silu backward passes, so gradients are unchanged.
    at::Tensor grad_h1 = ctx->needs_input_grad(0) ? at::silu_backward(g * h3, h1) : at::Tensor();
    at::Tensor grad_h3 = ctx->needs_input_grad(1) ? g * at::silu(h1) : at::Tensor();
    return {grad_h1, grad_h3};
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Modules and layer functions.

LinearImpl::LinearImpl(int64_t in_features, int64_t out_features, const at::TensorOptions& opts, bool with_bias) {
  weight = register_parameter("weight", new_parameter({out_features, in_features}, opts));
  if (with_bias) bias = register_parameter("bias", new_parameter({out_features}, opts));
}

at::Tensor LinearImpl::forward(const at::Tensor& x) {
  return with_hooks({x}, [this](const std::vector<at::Tensor>& in) {
    at::Tensor y = recompute_under_op_policy && !float8
                       ? at::linear(in[0], weight)
                       : saveable_linear(in[0], weight, float8.get(), float8_sharding.get(), float8_weight.get());
    // Under autocast the product is in the autocast dtype, as torch.nn.Linear's (bias included) is.
    if (bias.defined() && !bias_added_after) y = y + bias.to(y.scalar_type());
    return y;
  });
}

EmbeddingImpl::EmbeddingImpl(int64_t num_embeddings, int64_t dim, const at::TensorOptions& opts) {
  weight = register_parameter("weight", new_parameter({num_embeddings, dim}, opts));
}

at::Tensor EmbeddingImpl::forward(const at::Tensor& tokens_BS) {
  return with_hooks({tokens_BS}, [this](const std::vector<at::Tensor>& in) { return at::embedding(weight, in[0]); });
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_, const at::TensorOptions& opts) : eps(eps_) {
  weight = register_parameter("weight", new_parameter({dim}, opts));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps, compute_dtype(x));
}

at::Tensor RMSNormImpl::forward(const at::Tensor& x) {
  return with_hooks([&] { return rms_norm(x, weight, eps); });
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
  return RopeFunction::apply(x_BSnE, cis_SE2);
}

at::Tensor causal_attention(const at::Tensor& q_BHSE, const at::Tensor& k_BKSE, const at::Tensor& v_BKSE) {
  const auto H = q_BHSE.size(1), K = k_BKSE.size(1);
  if (H == K) return at::scaled_dot_product_attention(q_BHSE, k_BKSE, v_BKSE, {}, 0.0, /*is_causal=*/true);
  // Ask SDPA's own dispatcher which kernel it would run with grouped heads. Every fused kernel it
  // may choose (CPU flash; CUDA flash, cuDNN, and the memory-efficient one where it supports groups)
  // reads the K heads in place, saves them unrepeated and sums their gradients over the group. Only
  // its math backend would repeat them, and it also materializes the (S, S) scores; repeating them
  // here instead lets a fused kernel without group support run (e.g. memory-efficient in fp32 on CUDA).
  const auto backend = static_cast<at::SDPBackend>(
      at::_fused_sdp_choice(q_BHSE, k_BKSE, v_BKSE, {}, 0.0, /*is_causal=*/true, std::nullopt, /*enable_gqa=*/true));
  if (backend != at::SDPBackend::math)
    return at::scaled_dot_product_attention(q_BHSE, k_BKSE, v_BKSE, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                            /*enable_gqa=*/true);
  const auto B = k_BKSE.size(0), S = k_BKSE.size(2), E = k_BKSE.size(3);
  auto repeat = [&](const at::Tensor& t_BKSE) {
    return t_BKSE.unsqueeze(2).expand({B, K, H / K, S, E}).reshape({B, H, S, E});
  };
  return at::scaled_dot_product_attention(q_BHSE, repeat(k_BKSE), repeat(v_BKSE), {}, 0.0, /*is_causal=*/true);
}

namespace {

constexpr int64_t kLseAlign = 32;  // the CUDA memory-efficient kernel's log-sum-exp row padding

at::Tensor repeat_heads(const at::Tensor& t_BKSE, int64_t H) {
  const int64_t K = t_BKSE.size(1);
  if (K == H) return t_BKSE;
  return t_BKSE.unsqueeze(2)
      .expand({t_BKSE.size(0), K, H / K, t_BKSE.size(2), t_BKSE.size(3)})
      .reshape({t_BKSE.size(0), H, t_BKSE.size(2), t_BKSE.size(3)});
}

at::Tensor sum_heads(const at::Tensor& g_BHSE, int64_t K) {
  const int64_t H = g_BHSE.size(1);
  if (K == H) return g_BHSE;
  return g_BHSE.view({g_BHSE.size(0), K, H / K, g_BHSE.size(2), g_BHSE.size(3)}).sum(2);
}

}  // namespace

std::pair<at::Tensor, at::Tensor> attention_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          bool causal) {
  if (q.is_cuda()) {
    const int64_t H = q.size(1);
    auto r = at::_scaled_dot_product_efficient_attention(q, repeat_heads(k, H), repeat_heads(v, H), std::nullopt,
                                                         /*compute_log_sumexp=*/true, 0.0, causal);
    return {std::get<0>(r), std::get<1>(r).narrow(-1, 0, q.size(2))};
  }
  auto r = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal);
  return {std::get<0>(r), std::get<1>(r)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_block_backward(const at::Tensor& dout, const at::Tensor& q,
                                                                        const at::Tensor& k, const at::Tensor& v,
                                                                        const at::Tensor& out, const at::Tensor& lse,
                                                                        bool causal) {
  if (q.is_cuda()) {
    const int64_t H = q.size(1), K = k.size(1), Sq = q.size(2);
    const int64_t padded = (Sq + kLseAlign - 1) / kLseAlign * kLseAlign;
    const at::Tensor lse32 = lse.to(at::kFloat);
    at::Tensor lse_padded = padded == Sq ? lse32.contiguous() : at::constant_pad_nd(lse32, {0, padded - Sq}, 0.0);
    const at::Tensor zero = at::zeros({}, at::TensorOptions().dtype(at::kLong).device(q.device()));
    auto r = at::_scaled_dot_product_efficient_attention_backward(
        dout, q, repeat_heads(k, H), repeat_heads(v, H), at::Tensor(), out, lse_padded, zero, zero, 0.0,
        {true, true, true, false}, causal);
    return {std::get<0>(r), sum_heads(std::get<1>(r), K), sum_heads(std::get<2>(r), K)};
  }
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal);
}

AttentionKernels causal_attention_kernels() {
  AttentionKernels k;
  k.forward = [](const at::Tensor& q, const at::Tensor& key, const at::Tensor& v) {
    return attention_block_forward(q, key, v, /*causal=*/true);
  };
  k.backward = [](const at::Tensor& dout, const at::Tensor& q, const at::Tensor& key, const at::Tensor& v,
                  const at::Tensor& out, const at::Tensor& lse) {
    return attention_block_backward(dout.contiguous(), q, key, v, out, lse, /*causal=*/true);
  };
  return k;
}

AttentionImpl::AttentionImpl(int64_t dim, int64_t n_heads_, int64_t n_kv_heads_, int64_t head_dim_,
                             std::optional<double> qk_norm_eps, const at::TensorOptions& opts, bool bias)
    : n_heads(n_heads_), n_kv_heads(n_kv_heads_), head_dim(head_dim_) {
  wq = register_module("wq", Linear(dim, n_heads * head_dim, opts, bias));
  wk = register_module("wk", Linear(dim, n_kv_heads * head_dim, opts, bias));
  wv = register_module("wv", Linear(dim, n_kv_heads * head_dim, opts, bias));
  wo = register_module("wo", Linear(n_heads * head_dim, dim, opts, bias));
  if (qk_norm_eps) {
    q_norm = register_module("q_norm", RMSNorm(head_dim, *qk_norm_eps, opts));
    k_norm = register_module("k_norm", RMSNorm(head_dim, *qk_norm_eps, opts));
  }
}

at::Tensor AttentionImpl::forward(const at::Tensor& x_BSD, const at::Tensor& cis_SE2) {
  return with_hooks({x_BSD, cis_SE2}, [this](const std::vector<at::Tensor>& in) { return body(in[0], in[1]); });
}

at::Tensor AttentionImpl::body(const at::Tensor& x_BSD, const at::Tensor& cis_SE2) {
  const auto B = x_BSD.size(0), S = x_BSD.size(1);
  at::Tensor q_BSHE, k_BSKE, v_BSKE;
  {
    Float8SharedInputs shared_casts;  // wq, wk and wv in float8 cast their common input once
    // Heads are inferred (-1) so that a tensor-parallel shard of the projections works unchanged.
    q_BSHE = wq(x_BSD).view({B, S, -1, head_dim});
    k_BSKE = wk(x_BSD).view({B, S, -1, head_dim});
    if (q_norm) {  // QK-norm: per head, before the rotation
      q_BSHE = q_norm(q_BSHE);
      k_BSKE = k_norm(k_BSKE);
    }
    q_BSHE = apply_rope(q_BSHE, cis_SE2);
    k_BSKE = apply_rope(k_BSKE, cis_SE2);
    v_BSKE = wv(x_BSD).view({B, S, -1, head_dim});
  }
  // Kept with its log-sum-exp under per-operator activation checkpointing (activation_checkpoint.h).
  at::Tensor out_BHSE = saveable_attention(
      q_BSHE.transpose(1, 2), k_BSKE.transpose(1, 2), v_BSKE.transpose(1, 2),
      [this](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
        return attend ? attend(q, k, v) : causal_attention(q, k, v);
      },
      kernels);
  return wo(out_BHSE.transpose(1, 2).contiguous().view({B, S, -1}));
}

FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t hidden_dim, const at::TensorOptions& opts, bool bias) {
  w1 = register_module("w1", Linear(dim, hidden_dim, opts, bias));
  w2 = register_module("w2", Linear(hidden_dim, dim, opts, bias));
  w3 = register_module("w3", Linear(dim, hidden_dim, opts, bias));
}

at::Tensor swiglu(const at::Tensor& h1, const at::Tensor& h3) { return SwiGluFunction::apply(h1, h3); }

at::Tensor FeedForwardImpl::forward(const at::Tensor& x_BSD) {
  return with_hooks({x_BSD}, [this](const std::vector<at::Tensor>& in) {
    at::Tensor h1, h3;
    {
      Float8SharedInputs shared_casts;  // w1 and w3 in float8 cast their common input once
      h1 = w1(in[0]);
      h3 = w3(in[0]);
    }
    return w2(swiglu(h1, h3));
  });
}

}  // namespace titan::nn
