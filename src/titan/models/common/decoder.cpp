#include "titan/models/common/decoder.h"

#include "titan/common/error.h"
#include "titan/common/tensor_storage.h"
#include "titan/nn/init.h"

#include <ATen/ATen.h>

#include <cmath>
#include <set>

namespace titan {

nn::YarnScaling yarn_scaling(const YarnRope& y) {
  return nn::YarnScaling{y.factor, y.original_seq_len, y.beta_fast, y.beta_slow, y.mscale};
}

DecoderBlockImpl::DecoderBlockImpl(int64_t layer_id, const DecoderArgs& args, const at::TensorOptions& opts) {
  std::optional<double> qk_norm_eps;
  if (args.qk_norm) qk_norm_eps = args.norm_eps;
  if (args.mla) {
    const DecoderMLA& m = *args.mla;
    const nn::MLAOptions o{m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim};
    latent_attention = register_module(
        "attention", nn::MultiLatentAttention(args.dim, args.n_heads, o, args.norm_eps,
                                              args.yarn ? yarn_scaling(*args.yarn).softmax_scale() : 1.0, opts));
  } else {
    attention = register_module(
        "attention", nn::Attention(args.dim, args.n_heads, args.kv_heads(), args.head_dim(), qk_norm_eps, opts,
                                   args.attention_bias));
  }
  if (args.is_moe_layer(layer_id))
    moe = register_module("moe", nn::MoE(moe_options(args), opts));
  else
    feed_forward = register_module("feed_forward", nn::FeedForward(args.dim, args.ffn_hidden_dim(), opts, args.mlp_bias));
  attention_norm = register_module("attention_norm", nn::RMSNorm(args.dim, args.norm_eps, opts));
  ffn_norm = register_module("ffn_norm", nn::RMSNorm(args.dim, args.norm_eps, opts));
}

at::Tensor DecoderBlockImpl::forward(const at::Tensor& x_BSD, const at::Tensor& cis_SE2) {
  // The body depends on its inputs only (activation checkpointing may run it again in backward).
  return with_hooks({x_BSD, cis_SE2}, [this](const std::vector<at::Tensor>& in) {
    const at::Tensor &x = in[0], &cis = in[1];
    const at::Tensor normed = attention_norm(x);
    at::Tensor h_BSD = x + (attention ? attention->forward(normed, cis) : latent_attention->forward(normed, cis));
    return h_BSD + (moe ? moe->forward(ffn_norm(h_BSD)) : feed_forward(ffn_norm(h_BSD)));
  });
}

DecoderImpl::DecoderImpl(DecoderArgs args, const at::TensorOptions& opts, const std::vector<std::string>& modules)
    : args_(std::move(args)) {
  args_.validate();
  // Which modules this instance holds: all of them, or a pipeline stage's.
  std::set<std::string> wanted(modules.begin(), modules.end());
  auto holds = [&](const std::string& name) { return modules.empty() || wanted.erase(name) > 0; };
  const bool embed = holds("tok_embeddings");
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < args_.n_layers; ++i)
    if (holds("layers." + std::to_string(i))) ids.push_back(i);
  const bool final_norm = holds("norm"), head = holds("output");
  if (!wanted.empty()) {
    throw UserError("pipeline stage module '" + *wanted.begin() + "' is not in the model (" +
                    std::to_string(args_.n_layers) + " blocks: tok_embeddings, layers.0 to layers." +
                    std::to_string(args_.n_layers - 1) + ", norm, output); check parallelism.module_fqns_per_model_part "
                    "or pipeline_parallel_split_points");
  }
  // With tied embeddings a last stage without the embedding holds a copy of the table for the output
  // projection (shared_parameters()).
  if (embed || (head && args_.tie_embeddings))
    tok_embeddings = register_module("tok_embeddings", nn::Embedding(args_.vocab_size, args_.dim, opts));
  embeds_input_ = embed;
  layers = register_module("layers", torch::nn::ModuleDict());
  for (int64_t i : ids) layers->update({{std::to_string(i), DecoderBlock(i, args_, opts).ptr()}});
  if (final_norm) norm = register_module("norm", nn::RMSNorm(args_.dim, args_.norm_eps, opts));
  if (head && !args_.tie_embeddings) output = register_module("output", nn::Linear(args_.dim, args_.vocab_size, opts));
  tied_output_ = head && args_.tie_embeddings;
  std::optional<nn::RopeScaling> scaling;
  if (args_.rope_scaling) {
    const RopeScaling& s = *args_.rope_scaling;
    scaling = nn::RopeScaling{s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings};
  }
  freqs_ = args_.yarn ? nn::yarn_frequencies(args_.rope_dim(), args_.rope_theta, yarn_scaling(*args_.yarn))
                      : nn::rope_frequencies(args_.rope_dim(), args_.rope_theta, scaling);
}

std::vector<LanguageModelImpl::SharedParameter> DecoderImpl::shared_parameters() const {
  if (!args_.tie_embeddings || !tok_embeddings || embeds_input_ == tied_output_) return {};
  return {{"tok_embeddings.weight", /*primary=*/embeds_input_}};
}

std::vector<std::pair<std::string, DecoderBlockImpl*>> DecoderImpl::blocks() const {
  std::vector<std::pair<std::string, DecoderBlockImpl*>> out;
  for (const auto& item : layers->items())
    out.emplace_back("layers." + item.first + ".", item.second->as<DecoderBlockImpl>());
  return out;
}

std::vector<std::pair<std::string, nn::MoEImpl*>> DecoderImpl::moe_layers() const {
  std::vector<std::pair<std::string, nn::MoEImpl*>> out;
  for (const auto& [prefix, block] : blocks())
    if (block->moe) out.emplace_back(prefix + "moe.", block->moe.get());
  return out;
}

at::Tensor DecoderImpl::rope_table(int64_t seq_len, const at::Device& device) {
  TITAN_USER_CHECK(seq_len <= args_.max_seq_len, "sequence length ", seq_len,
                   " exceeds the model's max_seq_len ", args_.max_seq_len);
  auto key = std::make_pair(seq_len, device.str());
  auto it = rope_cache_.find(key);
  if (it != rope_cache_.end()) return it->second;
  at::Tensor angles_SE2 = at::outer(at::arange(seq_len, at::kLong).to(at::kFloat), freqs_);
  at::Tensor cis_SE2 = at::polar(at::ones_like(angles_SE2), angles_SE2).to(device);
  rope_cache_.emplace(key, cis_SE2);
  return cis_SE2;
}

void DecoderImpl::set_sequence_positions(int64_t degree, std::function<at::Tensor(int64_t)> positions) {
  sequence_degree_ = degree;
  sequence_positions_ = std::move(positions);
  local_rope_cache_.clear();
}

at::Tensor DecoderImpl::forward(const at::Tensor& input, int64_t seq_len) {
  return with_hooks([&] {
    // Tokens (B, S) into the embedding, or a previous stage's hidden states (B, S, D).
    at::Tensor h_BSD = embeds_input_ ? tok_embeddings(input) : input;
    // The RoPE table covers the sequence the rank attends with (under sequence parallelism the
    // blocks' input hooks gather it before attention): the whole sequence, or under context
    // parallelism the rows of this rank's positions.
    const int64_t local = seq_len > 0 ? seq_len : input.size(1);
    at::Tensor cis_SE2;
    if (sequence_positions_) {
      const auto key = std::make_pair(local, input.device().str());
      auto it = local_rope_cache_.find(key);
      if (it == local_rope_cache_.end()) {
        const int64_t whole = local * sequence_degree_;
        at::Tensor rows = sequence_positions_(whole).to(input.device());
        it = local_rope_cache_.emplace(key, rope_table(whole, input.device()).index_select(0, rows)).first;
      }
      cis_SE2 = it->second;
    } else {
      cis_SE2 = rope_table(local, input.device());
    }
    for (const auto& item : layers->items()) h_BSD = item.second->as<DecoderBlockImpl>()->forward(h_BSD, cis_SE2);
    if (norm) h_BSD = norm(h_BSD);
    if (output) return output(h_BSD);
    return tied_output_ ? at::linear(h_BSD, tok_embeddings->weight) : h_BSD;
  });
}

void DecoderImpl::init_elements(uint64_t seed, const std::string& name, at::Tensor rows, int64_t first) const {
  // torchtitan's initialization. Output layer: truncated normal, std dim^-0.5, cut off at 3 std; with
  // tied embeddings the one shared matrix (tok_embeddings.weight) takes the output layer's. Block
  // input projections: std 0.02; output projections (wo, w2, w3): depth-scaled std. nn.init.trunc_normal_'s
  // default cut-offs are absolute (-2, 2). Norm weights: ones.
  const double out_std = 1.0 / std::sqrt(static_cast<double>(args_.dim));
  auto ends_with = [&](const std::string& suffix) {
    return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with("norm.weight")) {
    init::ones(rows);
  } else if (ends_with(".bias")) {  // attention_bias / mlp_bias: zeros, as transformers initializes them
    init::zeros(rows);
  } else if (name == "tok_embeddings.weight" && !args_.tie_embeddings) {
    init::normal(rows, seed, name, first, 0.0, 1.0);
  } else if (name == "tok_embeddings.weight" || name == "output.weight") {
    init::trunc_normal(rows, seed, name, first, 0.0, out_std, -3 * out_std, 3 * out_std);
  } else {
    TITAN_ASSERT(name.rfind("layers.", 0) == 0, "init_rows: no initialization for parameter '", name, "'");
    const int64_t layer = std::stoll(name.substr(7, name.find('.', 7) - 7));
    // MoE layers as torchtitan initializes them: the router's gate, the experts' w2 and w3 and the
    // shared experts' w2 and w3 with the depth-scaled std, the experts' and shared experts' w1 0.02.
    const bool output_projection = ends_with("attention.wo.weight") || ends_with("feed_forward.w2.weight") ||
                                   ends_with("feed_forward.w3.weight") || ends_with("moe.router.gate.weight") ||
                                   ends_with("moe.experts.w2") || ends_with("moe.experts.w3") ||
                                   ends_with("moe.shared_experts.w2.weight") || ends_with("moe.shared_experts.w3.weight");
    // Multi-head latent attention's projections (wq or wq_a and wq_b, wkv_a, wkv_b) take 0.02, its
    // wo the depth-scaled std, as torchtitan's DeepSeek-V3 does.
    const bool input_projection = ends_with("attention.wq.weight") || ends_with("attention.wk.weight") ||
                                  ends_with("attention.wq_a.weight") || ends_with("attention.wq_b.weight") ||
                                  ends_with("attention.wkv_a.weight") || ends_with("attention.wkv_b.weight") ||
                                  ends_with("attention.wv.weight") || ends_with("feed_forward.w1.weight") ||
                                  ends_with("moe.experts.w1") || ends_with("moe.shared_experts.w1.weight");
    TITAN_ASSERT(input_projection || output_projection, "init_rows: no initialization for parameter '", name, "'");
    const double std = !output_projection ? 0.02
                       : args_.depth_init ? 0.02 / std::sqrt(2.0 * static_cast<double>(layer + 1))
                                          : 0.02 / std::sqrt(2.0 * static_cast<double>(args_.n_layers));
    init::trunc_normal(rows, seed, name, first, 0.0, std, -2.0, 2.0);
  }
}

double DecoderImpl::active_share(const std::string& name) const {
  if (!args_.moe || name.find(".moe.experts.") == std::string::npos) return 1.0;
  return static_cast<double>(args_.moe->top_k) / static_cast<double>(args_.moe->num_experts);
}

double DecoderImpl::flops_per_token(int64_t seq_len) const {
  // torchtitan (PaLM appendix B): 6 * (params - embedding params) for the matmuls, forward and
  // backward, plus 12 * L * H * E * S for attention scores and values (causal mask not discounted).
  // With MoE layers, torchtitan's count of active parameters: the routed experts' weights count
  // top_k / num_experts of them (router and shared experts count whole).
  double n = static_cast<double>(num_params());
  if (args_.moe) {
    for (const auto& p : named_parameters()) {
      const double share = active_share(p.key());
      if (share == 1.0) continue;
      double numel = 1;
      for (int64_t d : global_shape(p.key())) numel *= static_cast<double>(d);
      n -= numel * (1.0 - share);
    }
  }
  const double emb = static_cast<double>(args_.vocab_size * args_.dim);  // the global table (TP shards it)
  // Scores and values: 6 * L * H * (qk head dim + v head dim) * S (MLA's differ; 2 * head_dim otherwise).
  const int64_t head_dims = args_.mla ? args_.mla->qk_nope_head_dim + args_.mla->qk_rope_head_dim + args_.mla->v_head_dim
                                      : 2 * args_.head_dim();
  return 6.0 * (n - emb) + 6.0 * static_cast<double>(args_.n_layers * args_.n_heads * head_dims * seq_len);
}

}  // namespace titan
