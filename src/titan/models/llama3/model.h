// Llama 3 decoder (single-device code). Parameter names are torchtitan's native ones:
//   tok_embeddings.weight (V, D)
//   layers.N.attention_norm.weight (D)      layers.N.ffn_norm.weight (D)
//   layers.N.attention.wq.weight (H*E, D)   wk, wv: (K*E, D)   wo: (D, H*E)
//   layers.N.feed_forward.w1.weight (F, D)  w3: (F, D)         w2: (D, F)
//   norm.weight (D)                         output.weight (V, D)  (absent when embeddings are tied)
#pragma once

#include "titan/models/common/layers.h"
#include "titan/models/llama3/args.h"
#include "titan/models/model.h"

#include <torch/nn/modules/container/modulelist.h>

#include <map>
#include <utility>

namespace titan::llama3 {

class TransformerBlockImpl : public nn::HookedModule {
 public:
  TransformerBlockImpl(int64_t layer_id, const ModelArgs& args, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& x_BSD, const at::Tensor& cis_SE2);

  nn::Attention attention{nullptr};
  nn::FeedForward feed_forward{nullptr};
  nn::RMSNorm attention_norm{nullptr}, ffn_norm{nullptr};
};
TORCH_MODULE(TransformerBlock);

class TransformerImpl : public LanguageModelImpl {
 public:
  // opts: device and dtype of the parameters (use device meta for a shape-only model).
  TransformerImpl(ModelArgs args, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& tokens_BS) override;
  void init_elements(uint64_t seed, const std::string& name, at::Tensor out, int64_t first) const override;
  double flops_per_token(int64_t seq_len) const override;
  int64_t vocab_size() const override { return args_.vocab_size; }

  const ModelArgs& args() const { return args_; }
  // RoPE rotations cos + i sin (S, E/2), complex64 on `device`, computed once per (S, device).
  at::Tensor rope_table(int64_t seq_len, const at::Device& device);

  nn::Embedding tok_embeddings{nullptr};
  torch::nn::ModuleList layers{nullptr};
  nn::RMSNorm norm{nullptr};
  nn::Linear output{nullptr};  // null when embeddings are tied

 private:
  ModelArgs args_;
  at::Tensor freqs_;  // (E/2,) fp32 on the CPU
  std::map<std::pair<int64_t, std::string>, at::Tensor> rope_cache_;
};
TORCH_MODULE(Transformer);

}  // namespace titan::llama3
