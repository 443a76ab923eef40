// Mixture of experts: a token-choice top-k router, routed SwiGLU experts computed as grouped matrix
// multiplications over the tokens sorted by expert, optional shared experts (docs/moe.md).
//
// Shape legend: T tokens (batch x sequence), D model dim, E experts, K experts per token, F an
// expert's hidden size, N = T * K routed token copies.
//
// Routing, for x (T, D) (torchtitan's order):
//   scores  = softmax(x Wg^T) or sigmoid(x Wg^T)          fp32, (T, E)
//   choice  = scores + expert_bias                          the bias only chooses (aux-loss-free balancing)
//   groups  (n_groups > 1): choice viewed (T, G, E/G); a group's score is the sum of its top 2; the
//           topk_groups best groups are kept, the others' experts get -inf
//   ids     = the K largest entries of choice               (T, K)
//   weights = scores at ids (without the bias); / their sum + 1e-20 when route_norm; x route_scale
// Experts: each routed copy of a token goes through its expert's w2(silu(w1 x) * w3 x); the outputs,
// multiplied by their weights in fp32, are summed per token. No token is dropped (no capacity).
// Auxiliary load-balancing loss (optional; Qwen's global-batch form, transformers' normalization):
//   aux = E * sum_e f_e P_e,  f_e = copies routed to e / T,  P_e = sum_t p_te / T
// over the T tokens of the global micro-batch (every data-parallel rank's), p = softmax scores (sigmoid
// scores divided by their sum over experts); its gradient reaches the router through P only.
#pragma once

#include "titan/nn/hooks.h"
#include "titan/nn/layers.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <string>

namespace titan::nn {

struct MoEOptions {
  int64_t dim = 0;
  int64_t hidden_dim = 0;          // F: each routed expert's SwiGLU hidden size
  int64_t num_experts = 0;         // E
  int64_t top_k = 1;               // K
  int64_t num_shared_experts = 0;  // shared experts: one SwiGLU of hidden F x this count, on every token
  std::string score_func = "softmax";  // "softmax" | "sigmoid"
  bool route_norm = false;         // normalize the K weights of a token to sum 1
  double route_scale = 1.0;
  int64_t n_groups = 0;            // group-limited routing (DeepSeek): groups of E / n_groups experts
  int64_t topk_groups = 0;         // groups kept per token
  bool expert_bias = true;         // aux-loss-free load balancing (a bias that only steers the choice)
  double load_balance_coeff = 1e-3;  // the bias's step per update (update_expert_bias's rate)
  bool grouped_mm = true;          // false: one matmul per expert (the benchmark's baseline)
  double aux_loss_coeff = 0;       // the auxiliary load-balancing loss's coefficient (0: none)
  // Throws UserError naming the option that does not fit.
  void validate() const;
};

struct Routing {
  at::Tensor weights_TK;  // fp32
  at::Tensor ids_TK;      // int64, the chosen experts of each token
  at::Tensor scores_TE;   // fp32, the router's scores
  at::Tensor counts_E;    // int64, routed copies per expert
};

// The routing above for the gate's logits (T, E) (any float dtype) and the bias (E) or an undefined
// tensor. Differentiable in the logits through the weights. `force_load_balance` (torchtitan's
// debug.moe_force_load_balance, for measuring speed under perfect balance): copy k of token t goes to
// expert (t K + k) mod E whatever the scores, each with its score's weight (normalized and scaled as
// usual).
Routing route(const at::Tensor& logits_TE, const at::Tensor& expert_bias_E, const MoEOptions& options,
              bool force_load_balance = false);

// The order of the routed copies: row n of the sorted copies is copy perm[n] = t * K + k (token t's
// k-th choice), each copy once (N = T * K, int64); inv_N is its inverse (copy j sits in row inv[j]).
struct CopyOrder {
  at::Tensor perm_N, inv_N;
};
CopyOrder copy_order(const at::Tensor& perm_N);  // inv_N by a (deterministic) sort

// The routed copies' rows and back. dispatch_rows: row n = x_TD[perm[n] / K].
// combine_rows: y[t] = sum over k of round(weights_TK[t, k] * out_ND[the row of copy t * K + k]), each
// product in fp32 rounded to out's dtype (torchtitan's combine), the K summed in fp32 and rounded
// once. Both without atomics: a token's gradient (dispatch) and output (combine) sum its K rows in
// the order of k, so they are deterministic; CUDA runs the combine as one fused kernel each way
// (fused_kernels.h), the CPU as ATen operations, the meta device allocates what the kernel does.
at::Tensor dispatch_rows(const at::Tensor& x_TD, const CopyOrder& order, int64_t K);
at::Tensor combine_rows(const at::Tensor& out_ND, const at::Tensor& weights_TK, const CopyOrder& order);

// (N, D) rows sorted by expert, `counts` (E) rows each, through per-expert weights w (E, out, in):
// row block e times w[e]^T. at::_grouped_mm where its layout rules allow (16-byte aligned rows) and
// `grouped` is set, one matmul per expert otherwise; both give the same values.
at::Tensor grouped_linear(const at::Tensor& x_NI, const at::Tensor& w_EOI, const at::Tensor& counts_E,
                          bool grouped = true);

// Routed experts as stacked weights: w1, w3 (E, F, D), w2 (E, D, F) (each w[e] a Linear weight).
class GroupedExpertsImpl : public HookedModule {
 public:
  GroupedExpertsImpl(int64_t num_experts, int64_t dim, int64_t hidden_dim, const at::TensorOptions& opts,
                     bool grouped_mm = true);
  // x_ND sorted by expert, counts_E rows each.
  at::Tensor forward(const at::Tensor& x_ND, const at::Tensor& counts_E);
  at::Tensor w1, w2, w3;
  bool grouped_mm = true;
  // The float8 grouped-matmul recipe (set by the "quantize.grouped_mm.float8" converter; null: the
  // matmuls run in the compute dtype).
  std::shared_ptr<const Float8Recipe> float8;
};
TORCH_MODULE(GroupedExperts);

// The gate (E, D): router.gate.weight.
class RouterImpl : public HookedModule {
 public:
  RouterImpl(int64_t dim, int64_t num_experts, const at::TensorOptions& opts);
  at::Tensor forward(const at::Tensor& x_TD);  // logits (T, E)
  Linear gate{nullptr};
};
TORCH_MODULE(Router);

// Where the routed copies are computed. Without expert parallelism, here, by every expert; with it,
// each copy travels to the rank that holds its expert and its output comes back (docs/moe.md).
struct ExpertExchange {
  at::Tensor x_ND;      // the rows this rank's experts compute, sorted by local expert
  at::Tensor counts_E;  // rows per local expert
  // The experts' outputs for x_ND back to the routed copies of this rank, in their order.
  std::function<at::Tensor(const at::Tensor& out_ND)> back;
};
// routed_ND: this rank's routed copies sorted by expert, counts_E (all E experts) rows each.
using ExchangeFn = std::function<ExpertExchange(const at::Tensor& routed_ND, const at::Tensor& counts_E)>;

class MoEImpl : public HookedModule {
 public:
  MoEImpl(MoEOptions options, const at::TensorOptions& opts);
  // x (B, S, D) -> (B, S, D). Adds the step's routed copies per expert to tokens_per_expert (not when
  // an activation-checkpointed body is recomputed, nor when count_tokens is off).
  at::Tensor forward(const at::Tensor& x_BSD);

  const MoEOptions& options() const { return options_; }
  Router router{nullptr};
  GroupedExperts experts{nullptr};
  FeedForward shared_experts{nullptr};  // null without shared experts
  at::Tensor expert_bias;              // (E) fp32 buffer, undefined without balancing
  at::Tensor tokens_per_expert;        // (E) fp32 buffer: routed copies since the last bias update
  bool count_tokens = true;            // off while evaluating
  ExchangeFn exchange;                 // expert parallelism's, or none (every expert is here)
  // The auxiliary load-balancing loss. Its weight in the training loss (the coefficient over the
  // MoE layers and the micro-batches of a step; 0: none) is set by the trainer. The loss is not added
  // to the output: an autograd function on the output adds its gradient in backward (so pipeline
  // stages and activation checkpointing need nothing else). global_counts sums this forward's
  // routed copies per expert (E, fp32) over the ranks whose tokens make the global micro-batch
  // (none: this rank's tokens are all of it). aux_loss_terms adds up this layer's local terms
  // E * sum_e f_e sum_{t here} p_te / T (summed over those ranks, they make the layer's aux) of the
  // step's forward passes (not recomputations); the trainer reads and zeroes it.
  double aux_loss_weight = 0;
  // debug.moe_force_load_balance: route round-robin (see route()).
  bool force_load_balance = false;
  std::function<at::Tensor(const at::Tensor& counts_E)> global_counts;
  at::Tensor aux_loss_terms;           // fp32 scalar, undefined until the first term

 private:
  MoEOptions options_;
};
TORCH_MODULE(MoE);

// The layer's local auxiliary-loss term E * sum_e (counts_E / T) * sum_t p_te / T, with T = the
// global counts' sum / K, p the routing's scores normalized over the experts (routing.scores_TE).
// Differentiable in the scores.
at::Tensor aux_loss_term(const Routing& routing, const at::Tensor& global_counts_E, const MoEOptions& options);

// torchtitan's auxiliary-loss-free update of one layer's bias from its token counts (E): every
// expert's bias moves by rate * sign(mean - count), then the moves are centred to zero mean.
void update_expert_bias(at::Tensor& expert_bias_E, const at::Tensor& counts_E, double rate);

}  // namespace titan::nn
