// Building blocks of decoder-only transformers, written for one device.
//
// Shape legend used in names: B batch, S sequence, D model dim, H query heads, K key/value heads,
// E head dim, F feed-forward hidden dim, V vocabulary, n any head count.
//
// Memory: RMSNorm, RoPE and SwiGLU are autograd functions with written-out backward passes that save
// only what their backward needs, in the activations' own dtype (fp32 only transiently, inside one
// call); grouped-query attention lets the attention kernel read the shared key/value heads in place.
// docs/memory.md lists what each layer saves for backward, with measured figures.
//
// Each module creates its parameters with the TensorOptions it is given (device meta for shape-only
// models, cpu or cuda for real ones; without storage under DeferAllocation) and initializes them only
// when init_weights is called.
#pragma once

#include "titan/nn/hooks.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace titan::nn {

struct Float8Recipe;
struct Float8Sharding;
struct Float8Weight;

// y = x W^T (+ b), W (out, in), b (out) when built with a bias (Llama and Qwen3 have none; their
// configs' attention_bias / mlp_bias add them). With a float8 recipe (set by the float8 converter,
// nn/float8.h) its matmuls run in float8; the bias is added in the output's dtype.
class LinearImpl : public HookedModule {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, const at::TensorOptions& opts, bool bias = false);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;
  at::Tensor bias;  // undefined without a bias
  // Set by tensor parallelism on a row-wise split layer: its output is a partial sum that is reduced
  // over the ranks after the layer, and the bias is added once, after that reduction.
  bool bias_added_after = false;
  std::shared_ptr<const Float8Recipe> float8;
  std::shared_ptr<const Float8Sharding> float8_sharding;  // tensor parallelism's split (float8 layers)
  std::shared_ptr<const Float8Weight> float8_weight;      // the weight cast beforehand (FSDP's float8 all-gather)
  // Set by nn::force_recompute_linears: inside a body checkpointed with a per-operator policy this
  // layer's plain matmul is always recomputed and not counted by the policy.
  bool recompute_under_op_policy = false;
};
TORCH_MODULE(Linear);

// Token embedding table (V, D).
class EmbeddingImpl : public HookedModule {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t dim, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& tokens_BS);
  at::Tensor weight;
};
TORCH_MODULE(Embedding);

// RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight, computed in fp32 whatever x's dtype.
// Saves x (its own dtype), the weight and the fp32 reciprocal RMS per row. The result has x's dtype,
// or the autocast dtype when autocast is on for x's device (for a meta tensor: CUDA's, as titan
// estimate's dry run emulates it): the layers after a norm are matmuls that
// would each cast it to that dtype and save their own copy; casting once lets them share one.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// RMSNorm module (weight (D)) over nn::rms_norm.
class RMSNormImpl : public HookedModule {
 public:
  RMSNormImpl(int64_t dim, double eps, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& x);
  void reset_parameters();  // weight = 1
  at::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// Rotary position embedding tables. Pairs are interleaved as in Meta's Llama
// ((x0, x1), (x2, x3), ...), i.e. torchtitan's complex formulation.
struct RopeScaling {
  double factor, low_freq_factor, high_freq_factor;
  int64_t original_max_position_embeddings;
};
// Rotation frequencies (E/2,) in fp32, with optional Llama 3.1 scaling.
at::Tensor rope_frequencies(int64_t head_dim, double theta, const std::optional<RopeScaling>& scaling);
// Rotates x (B, S, n, E) by the angles positions (S,) x freqs (E/2,), given as
// cis = cos + i sin (S, E/2) complex64. The rotation runs in fp32 on one transient copy and returns
// x's dtype; backward is the inverse rotation, so nothing but the table is saved.
at::Tensor apply_rope(const at::Tensor& x_BSnE, const at::Tensor& cis_SE2);

// Causal attention of H query heads over K key/value heads (K divides H; query head h reads key/value
// head h / (H/K)). When K < H the shared heads are read in place by every SDPA kernel that takes
// grouped heads; they are repeated (copied) only where SDPA would otherwise run its math backend.
at::Tensor causal_attention(const at::Tensor& q_BHSE, const at::Tensor& k_BKSE, const at::Tensor& v_BKSE);

// Attention through the fused kernels that also return the log-sum-exp of each query row's scores,
// and back-propagate from it without running the forward again. q (B, H, Sq, E), k and v
// (B, K, Sk, E), K dividing H. Forward: (output (B, H, Sq, E) in q's dtype, log-sum-exp (B, H, Sq)).
// CPU: the flash kernel, reading grouped heads in place. CUDA: the memory-efficient kernel, whose
// log-sum-exp rows are padded to a multiple of 32 (cut here, padded again for backward) and which
// takes no grouped heads (they are repeated, their gradients summed back).
std::pair<at::Tensor, at::Tensor> attention_block_forward(const at::Tensor& q_BHSE, const at::Tensor& k_BKSE,
                                                          const at::Tensor& v_BKSE, bool causal);
// (dq, dk, dv) from the output's gradient, the inputs, the output and its log-sum-exp.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_block_backward(const at::Tensor& dout, const at::Tensor& q,
                                                                        const at::Tensor& k, const at::Tensor& v,
                                                                        const at::Tensor& out, const at::Tensor& lse,
                                                                        bool causal);

// An attention as two halves, for per-operator activation checkpointing (activation_checkpoint.h):
// forward returns (output, log-sum-exp); backward returns (dq, dk, dv) given the output's gradient,
// q, k, v, the output and the log-sum-exp.
struct AttentionKernels {
  std::function<std::pair<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&)> forward;
  std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, const at::Tensor&, const at::Tensor&)>
      backward;
};
// causal_attention's halves (attention_block_forward/backward, causal).
AttentionKernels causal_attention_kernels();

// Grouped-query causal self-attention through ATen's scaled_dot_product_attention, with heads of
// head_dim (not necessarily dim / n_heads); `bias`: the four projections have biases (transformers'
// attention_bias). With qk_norm_eps, q and k are normalized per head by an
// RMSNorm over head_dim (weights q_norm, k_norm (E)) before RoPE: Qwen3's QK-norm.
class AttentionImpl : public HookedModule {
 public:
  AttentionImpl(int64_t dim, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                std::optional<double> qk_norm_eps, const at::TensorOptions& opts, bool bias = false);
  at::Tensor forward(const at::Tensor& x_BSD, const at::Tensor& cis_SE2);
  // Heads are read from the projections' outputs, so a tensor-parallel shard of them (a subset of
  // the heads) runs the same code; n_heads and n_kv_heads stay the model's totals.
  int64_t n_heads, n_kv_heads, head_dim;
  Linear wq{nullptr}, wk{nullptr}, wv{nullptr}, wo{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // QK-norm only
  // The attention of the rotated q (B, H, S, E) over k, v (B, K, S, E): causal_attention unless a
  // parallelism replaces it (context parallelism's ring attention over the sequence's shards).
  std::function<at::Tensor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v)> attend;
  // The same attention as two halves (output and log-sum-exp, and the backward from them): what
  // per-operator activation checkpointing keeps and back-propagates through. Set with `attend`.
  AttentionKernels kernels = causal_attention_kernels();

 private:
  at::Tensor body(const at::Tensor& x_BSD, const at::Tensor& cis_SE2);
};
TORCH_MODULE(Attention);

// silu(h1) * h3, saving h1 and h3 only (silu is recomputed in backward).
at::Tensor swiglu(const at::Tensor& h1, const at::Tensor& h3);

// SwiGLU: w2(silu(w1 x) * w3 x), the three projections with biases when `bias`.
class FeedForwardImpl : public HookedModule {
 public:
  FeedForwardImpl(int64_t dim, int64_t hidden_dim, const at::TensorOptions& opts, bool bias = false);
  at::Tensor forward(const at::Tensor& x_BSD);
  Linear w1{nullptr}, w2{nullptr}, w3{nullptr};
};
TORCH_MODULE(FeedForward);

}  // namespace titan::nn
