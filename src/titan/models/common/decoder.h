// The decoder-only transformer every dense family is built on (single-device code; parallelisms are
// applied from outside by decoder_parallelize.h). Parameter names are torchtitan's native ones:
//   tok_embeddings.weight (V, D)
//   layers.N.attention_norm.weight (D)      layers.N.ffn_norm.weight (D)
//   layers.N.attention.wq.weight (H*E, D)   wk, wv: (K*E, D)   wo: (D, H*E)
//   layers.N.attention.q_norm.weight (E)    k_norm: (E)        (QK-norm only, e.g. Qwen3)
//   multi-head latent attention instead (DeepSeek-V3, nn/mla.h): layers.N.attention.wq.weight or
//   wq_a, q_norm, wq_b; wkv_a, kv_norm, wkv_b, wo
//   layers.N.feed_forward.w1.weight (F, D)  w3: (F, D)         w2: (D, F)
//   MoE layers instead of feed_forward (nn/moe.h), Fe an expert's hidden size, Xe experts:
//   layers.N.moe.router.gate.weight (Xe, D)  layers.N.moe.experts.w1 (Xe, Fe, D)  w3: (Xe, Fe, D)  w2: (Xe, D, Fe)
//   layers.N.moe.shared_experts.w1.weight (Fe*shared, D), w3, w2   (with shared experts)
//   buffers layers.N.moe.expert_bias (Xe) (checkpointed), layers.N.moe.tokens_per_expert (Xe)
//   norm.weight (D)                         output.weight (V, D)  (absent when embeddings are tied)
#pragma once

#include "titan/models/common/decoder_args.h"
#include "titan/models/model.h"
#include "titan/nn/layers.h"
#include "titan/nn/mla.h"
#include "titan/nn/moe.h"

#include <torch/nn/modules/container/moduledict.h>

#include <functional>
#include <map>
#include <utility>

namespace titan {

// nn's YaRN scaling of the arguments' (the softmax scale and frequencies of MLA models).
nn::YarnScaling yarn_scaling(const YarnRope& y);

class DecoderBlockImpl : public nn::HookedModule {
 public:
  DecoderBlockImpl(int64_t layer_id, const DecoderArgs& args, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& x_BSD, const at::Tensor& cis_SE2);

  nn::Attention attention{nullptr};                      // grouped-query attention, or
  nn::MultiLatentAttention latent_attention{nullptr};   // MLA (args.mla), also named "attention"
  nn::FeedForward feed_forward{nullptr};  // null in a MoE layer
  nn::MoE moe{nullptr};                   // null in a dense layer
  nn::RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};
};
TORCH_MODULE(DecoderBlock);

// The whole model, or one pipeline stage of it: the modules named in `modules` (the model's split,
// e.g. {"tok_embeddings", "layers.0", "layers.1"}), with their global names. A stage's forward takes
// tokens (B, S) when it holds the embedding and the previous stage's hidden states (B, S, D) when
// not, and returns logits (B, S, V) when it holds the output projection, hidden states otherwise.
class DecoderImpl : public LanguageModelImpl {
 public:
  // opts: device and dtype of the parameters (use device meta for a shape-only model). modules:
  // empty for the whole model. Throws UserError for a name the model does not have. A last stage of
  // a tied model holds its own copy of the embedding table (shared_parameters()).
  DecoderImpl(DecoderArgs args, const at::TensorOptions& opts, const std::vector<std::string>& modules = {});
  at::Tensor forward(const at::Tensor& input, int64_t seq_len = 0) override;
  void init_elements(uint64_t seed, const std::string& name, at::Tensor out, int64_t first) const override;
  double flops_per_token(int64_t seq_len) const override;
  double active_share(const std::string& name) const override;
  int64_t vocab_size() const override { return args_.vocab_size; }
  int64_t hidden_size() const override { return args_.dim; }

  const DecoderArgs& args() const { return args_; }
  // RoPE rotations cos + i sin (S, E/2), complex64 on `device`, computed once per (S, device).
  at::Tensor rope_table(int64_t seq_len, const at::Device& device);
  // Context parallelism: the input holds, of every sequence of `degree` times its length, the
  // tokens at positions(that length) (long, ascending per chunk); RoPE rotates them by those positions.
  void set_sequence_positions(int64_t degree, std::function<at::Tensor(int64_t seq_len)> positions);

  // Whether forward returns logits (the whole model, or the last pipeline stage).
  bool holds_output() const { return output || tied_output_; }
  // A pipeline stage of a tied model that holds the output but not the input embedding keeps its
  // own copy of the table (tok_embeddings.weight), shared with the first stage.
  std::vector<SharedParameter> shared_parameters() const override;
  // The blocks this instance holds, in order, with their name prefixes ("layers.3.").
  std::vector<std::pair<std::string, DecoderBlockImpl*>> blocks() const;
  // The MoE layers this instance holds, with their name prefixes ("layers.3.moe.").
  std::vector<std::pair<std::string, nn::MoEImpl*>> moe_layers() const override;

  nn::Embedding tok_embeddings{nullptr};  // null in a stage without it (or without the tied output)
  torch::nn::ModuleDict layers{nullptr};  // keyed by layer id ("3"): a stage keeps the global names
  nn::RMSNorm norm{nullptr};              // null in a stage without it
  nn::Linear output{nullptr};             // null when embeddings are tied, or in a stage without it

 private:
  DecoderArgs args_;
  bool tied_output_ = false;  // holds the output projection as the embedding's table
  bool embeds_input_ = false;  // embeds tokens (the whole model, or the first pipeline stage)
  at::Tensor freqs_;  // (E/2,) fp32 on the CPU
  std::map<std::pair<int64_t, std::string>, at::Tensor> rope_cache_;
  int64_t sequence_degree_ = 1;                             // context-parallel ranks
  std::function<at::Tensor(int64_t)> sequence_positions_;  // null without context parallelism
  std::map<std::pair<int64_t, std::string>, at::Tensor> local_rope_cache_;  // the rank's rows of the table
};
TORCH_MODULE(Decoder);

}  // namespace titan
