// Tensor parallelism (Megatron-style) over the `tp` mesh dimension, applied from outside a model
// written for one device: the model's parallelize function declares its plan with the styles below,
// and these replace parameters by shards and put communication around modules through their hooks.
//
// Shape legend: B batch, S sequence, D model dim, V vocabulary, n the tp degree.
//
// Styles (torchtitan's names in brackets):
//   column-wise  [ColwiseParallel]  Linear weight (out, in) sharded on dim 0: the layer computes its
//                                   slice of the output features from the whole input.
//   row-wise     [RowwiseParallel]  weight sharded on dim 1: the layer reads its slice of the input
//                                   features and produces a partial sum of the whole output.
//   vocabulary   [RowwiseParallel on the embedding]  the table (V, D) sharded on dim 0; a token
//                                   outside a rank's rows looks up zeros, the sum over ranks is the
//                                   embedding.
//   region       [PrepareModuleInput + the output of the row-wise layer]  a module whose input comes
//                                   from the residual stream and whose output returns to it (attention,
//                                   the feed-forward): its input is made whole before the column-wise
//                                   layers and its partial output summed after the row-wise one.
//   replicated   norms: every rank holds the whole weight.
//
// Sequence parallel (torchtitan's default with TP): outside the regions the residual stream is
// sharded on the sequence, (B, S/n, D) per rank, so norms and residual adds run on 1/n of the tokens
// and activations there take 1/n of the memory. Into a region: all-gather on the sequence (backward:
// reduce-scatter); out of one: reduce-scatter on the sequence (backward: all-gather). The norms'
// weights see only their rank's tokens, so their gradients are partial sums, added over tp after
// backward. Without sequence parallel the residual stream is whole on every rank: into a region the
// identity (backward: all-reduce), out of one an all-reduce (backward: the identity).
//
// Loss parallel: the output layer's logits stay sharded on the vocabulary (B, S, V/n) and the
// cross-entropy combines per-rank maxima, sums of exponentials and target logits across tp; the
// full (B, S, V) logits never exist. Without it the logits are all-gathered on the vocabulary.
//
// Async TP: the all-gather into a region and the reduce-scatter out of it are decomposed into chunks
// of the sequence, each chunk's communication overlapping the matmuls of another (on CUDA the
// collectives run on the communicator's own stream; on CPU on Gloo's threads). The first column-wise
// layer of a region computes from the chunks as they arrive and hands the gathered input to the
// others; the row-wise layer reduce-scatters its output chunk by chunk as it computes it. Results
// equal plain TP.
#pragma once

#include "titan/distributed/mesh.h"
#include "titan/distributed/placement.h"
#include "titan/nn/layers.h"
#include "titan/nn/loss.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace titan::dist {

// ---- Communication as autograd functions: each one's backward issues the dual collective.
// All-gather along `dim` (backward: reduce-scatter along `dim`).
at::Tensor tp_all_gather(const at::Tensor& x, Group& group, int64_t dim);
// Reduce-scatter (sum) along `dim` (backward: all-gather along `dim`).
at::Tensor tp_reduce_scatter(const at::Tensor& x, Group& group, int64_t dim);
// The identity (backward: all-reduce).
at::Tensor tp_copy(const at::Tensor& x, Group& group);
// All-reduce (backward: the identity).
at::Tensor tp_all_reduce(const at::Tensor& x, Group& group);
// All-gather along `dim` of a tensor every rank computes its own slice of, from the same inputs
// (backward: this rank's slice of the gradient, which every rank holds whole).
at::Tensor tp_gather_slices(const at::Tensor& x, Group& group, int64_t dim);

// Sum over tokens of the cross-entropy of logits sharded on the vocabulary: logits_NVn holds
// vocabulary entries [vocab_begin, vocab_begin + Vn) of each row; labels_N are global ids (kIgnoreIndex
// skipped). Equals nn::cross_entropy_sum of the gathered logits; every rank gets the whole loss and
// the gradient of its own slice. Per chunk of tokens two all-reduces of 1 and 2 floats per token
// (the row maxima, then the sums of exponentials with the target logits); nothing in backward.
at::Tensor vocab_parallel_cross_entropy_sum(const at::Tensor& logits_NVn, const at::Tensor& labels_N, Group& group,
                                            int64_t vocab_begin, int64_t chunk_tokens = nn::kLossChunkTokens);

// ---- Async TP's decomposed collectives (sequence dim 1 of (B, S, ...) activations).
// x_BSnD: this rank's sequence shard. Returns x W_iᵀ for each weight on the whole sequence, and the
// gathered x (for layers that read the same input): the all-gather runs in `chunks` pieces, the
// matmuls of a piece overlapping the communication of the next. Backward: the dual (reduce-scatter
// of the input gradient in pieces overlapping the weight-gradient matmuls).
std::vector<at::Tensor> all_gather_matmul(const at::Tensor& x_BSnD, const std::vector<at::Tensor>& weights,
                                          Group& group, int64_t chunks);
// x_BSF (whole sequence, sharded features): reduce-scatter on the sequence of x Wᵀ (partial sums),
// in `chunks` pieces, each piece's reduce-scatter overlapping the next piece's matmul. Backward: the
// output gradient all-gathered in pieces overlapping the input-gradient matmuls.
at::Tensor matmul_reduce_scatter(const at::Tensor& x_BSF, const at::Tensor& weight, Group& group, int64_t chunks);

struct TensorParallelOptions {
  bool sequence_parallel = true;  // parallelism.enable_sequence_parallel
  bool loss_parallel = true;      // !parallelism.disable_loss_parallel
  bool async = false;             // parallelism.enable_async_tensor_parallel (needs sequence parallel)
};

// A UserError when sequence parallel cannot split sequences of seq_len tokens over tp ranks.
void check_sequence_length(int64_t seq_len, int64_t tp, bool sequence_parallel, const char* key = "training.seq_len");

// Applies the styles above over `group`. Each style replaces the parameters it shards (a parameter
// with values keeps its slice; one built without storage gets only the shard's shape, to be filled
// by whoever materializes it) and returns the placements of the parameters it touched, by their
// names relative to the module.
class TensorParallel {
 public:
  TensorParallel(Group& group, TensorParallelOptions options);
  Group& group() const { return group_; }
  const TensorParallelOptions& options() const { return options_; }
  int degree() const { return group_.size(); }

  std::vector<std::pair<std::string, Placement>> column_wise(nn::LinearImpl& linear);
  std::vector<std::pair<std::string, Placement>> row_wise(nn::LinearImpl& linear);
  std::vector<std::pair<std::string, Placement>> vocabulary(nn::EmbeddingImpl& embedding);
  std::vector<std::pair<std::string, Placement>> replicated(torch::nn::Module& module);
  // The communication around a region whose input goes to the column-wise layers `first` (under
  // async TP the first of them gathers for all) and whose output comes from the row-wise layer `last`.
  void region(nn::HookedModule& module, const std::vector<nn::LinearImpl*>& first, nn::LinearImpl& last);
  // Under sequence parallel: the output of `module` (the embedding, partial sums) reduce-scattered
  // on the sequence; without: all-reduced.
  void reduce_output(nn::HookedModule& module);
  // Under sequence parallel: the output of `module` (the final norm, sequence-sharded) all-gathered on
  // the sequence before the column-wise output layer; without: the identity (backward: all-reduce).
  void gather_output(nn::HookedModule& module);
  // The logits of `module` (the model) sharded on the vocabulary made whole (when loss parallel is off).
  void gather_logits(nn::HookedModule& module);
  // Whether gradients of replicated parameters are partial sums over tp (sequence parallel).
  bool replicated_grads_partial() const { return options_.sequence_parallel; }

 private:
  Placement shard(at::Tensor& param, int64_t dim) const;
  // The split of float8 layers along logical dim `dim` ('N', 'K' or 'M', nn/float8.h): one object per
  // dim, shared by the layers split alike (their amax reductions are then one, which lets layers on
  // one input share its cast: nn::Float8SharedInputs).
  std::shared_ptr<const nn::Float8Sharding> float8_split(char dim);
  Group& group_;
  TensorParallelOptions options_;
  std::map<char, std::shared_ptr<const nn::Float8Sharding>> float8_splits_;
};

}  // namespace titan::dist
