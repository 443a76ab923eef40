#include "titan/models/common/decoder_args.h"

#include "titan/common/error.h"
#include "titan/nn/moe.h"

namespace titan {

int64_t DecoderArgs::ffn_hidden_dim() const {
  if (hidden_dim > 0) return hidden_dim;
  // FeedForward is built with hidden_dim = 4 * dim and reduces it to 2/3 of that.
  int64_t hidden = static_cast<int64_t>(2.0 * static_cast<double>(4 * dim) / 3.0);
  if (ffn_dim_multiplier) hidden = static_cast<int64_t>(*ffn_dim_multiplier * static_cast<double>(hidden));
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

void DecoderArgs::validate() const {
  TITAN_USER_CHECK(dim > 0 && n_layers > 0 && n_heads > 0 && vocab_size > 0 && multiple_of > 0 && hidden_dim >= 0 &&
                       attention_head_dim >= 0 && n_kv_heads >= 0,
                   "model: dim, n_layers, n_heads, vocab_size and multiple_of must be positive (head_dim, "
                   "hidden_dim and n_kv_heads positive or unset)");
  if (mla) {
    const DecoderMLA& m = *mla;
    TITAN_USER_CHECK(m.kv_lora_rank > 0 && m.qk_nope_head_dim >= 0 && m.qk_rope_head_dim > 0 &&
                         m.qk_rope_head_dim % 2 == 0 && m.v_head_dim > 0 && m.q_lora_rank >= 0 &&
                         m.v_head_dim <= m.qk_nope_head_dim + m.qk_rope_head_dim,
                     "model: multi-head latent attention needs kv_lora_rank > 0, an even qk_rope_head_dim > 0, "
                     "qk_nope_head_dim >= 0, q_lora_rank >= 0 and 0 < v_head_dim <= qk_nope_head_dim + qk_rope_head_dim");
    TITAN_USER_CHECK(!rope_scaling, "model: multi-head latent attention scales RoPE with YaRN, not Llama 3.1's scaling");
    TITAN_USER_CHECK(!attention_bias, "model: multi-head latent attention has no attention biases (attention_bias)");
  } else {
    TITAN_USER_CHECK(attention_head_dim > 0 || dim % n_heads == 0, "model: dim ", dim, " is not divisible by n_heads ",
                     n_heads, " (or set head_dim)");
    TITAN_USER_CHECK(n_heads % kv_heads() == 0, "model: n_heads ", n_heads, " is not a multiple of n_kv_heads ",
                     kv_heads());
    TITAN_USER_CHECK(head_dim() % 2 == 0, "model: head_dim ", head_dim(), " must be even for RoPE");
    TITAN_USER_CHECK(!yarn, "model: YaRN RoPE scaling is implemented for multi-head latent attention only");
  }
  if (yarn)
    TITAN_USER_CHECK(yarn->factor > 0 && yarn->original_seq_len > 0 && yarn->beta_fast > yarn->beta_slow &&
                         yarn->beta_slow > 0,
                     "model: YaRN needs factor > 0, original_seq_len > 0 and beta_fast > beta_slow > 0");
  TITAN_USER_CHECK(norm_eps > 0 && rope_theta > 0, "model: norm_eps and rope_theta must be positive");
  if (rope_scaling) {
    const RopeScaling& s = *rope_scaling;
    TITAN_USER_CHECK(s.factor > 0 && s.high_freq_factor > s.low_freq_factor && s.low_freq_factor > 0 &&
                         s.original_max_position_embeddings > 0,
                     "model: RoPE scaling needs factor > 0, high_freq_factor > low_freq_factor > 0 and a positive "
                     "original_max_position_embeddings");
  }
  if (moe) {
    TITAN_USER_CHECK(moe->n_dense_layers >= 0 && moe->n_dense_layers <= n_layers, "model: moe n_dense_layers ",
                     moe->n_dense_layers, " must be between 0 and n_layers ", n_layers);
    TITAN_USER_CHECK(moe->load_balance_coeff >= 0, "model: moe load_balance_coeff must not be negative");
    moe_options(*this).validate();
  }
}

nn::MoEOptions moe_options(const DecoderArgs& args) {
  TITAN_ASSERT(args.moe, "moe_options: the model has no MoE layers");
  const DecoderMoE& m = *args.moe;
  nn::MoEOptions o;
  o.dim = args.dim;
  o.hidden_dim = m.hidden_dim;
  o.num_experts = m.num_experts;
  o.top_k = m.top_k;
  o.num_shared_experts = m.num_shared_experts;
  o.score_func = m.score_func;
  o.route_norm = m.route_norm;
  o.route_scale = m.route_scale;
  o.n_groups = m.n_groups;
  o.topk_groups = m.topk_groups;
  o.expert_bias = m.load_balance_coeff > 0;
  o.load_balance_coeff = m.load_balance_coeff;
  o.aux_loss_coeff = m.aux_loss_coeff;
  return o;
}

}  // namespace titan
