// Context parallelism: every sequence is split over the ranks of the `cp` mesh dimension, and
// attention runs as ring attention over them.
//
// The split. With load balancing ("headtail", the default), a sequence of S tokens is cut into 2·cp
// chunks of S/(2·cp) and rank r holds chunks r and 2·cp-1-r, in that order: under a causal mask
// every rank then does the same attention work (an early chunk attends to few keys, its partner
// late chunk to many). Without it ("none"), rank r holds the r-th of cp contiguous chunks. The
// tokens, the labels and the RoPE positions all follow the same split; everything but attention is
// per token and runs on the rank's tokens unchanged.
//
// Ring attention. Each rank computes the attention of its queries over the keys and values of
// every rank, one source rank's block at a time, each block by the fused SDPA kernel that returns
// its log-sum-exp (CPU: the CPU flash kernel; CUDA: the memory-efficient kernel); the blocks are
// merged exactly by their log-sum-exps, in float32. A block pair is computed in full, causally (the
// rank's own block) or not at all, from the chunks' global positions; under headtail every other
// block is half the work (the first chunk of keys, or the second chunk of queries). Backward runs
// the kernel's backward per block against the merged output and log-sum-exp (exact), and the key
// and value gradients travel back to their owners. How K/V travel (parallelism.
// context_parallel_rotate_method):
//   - "allgather": one all-gather of every rank's K/V before the blocks; backward all-gathers them
//     again and reduce-scatters the K/V gradients. cp× the K/V in memory while attention runs.
//   - "alltoall": a ring. K/V move one rank on per block (an all-to-all whose only non-empty part
//     goes to the next rank: a send and a receive as one collective, which cannot deadlock on
//     NCCL); the next block's transfer is posted before the current block is computed, so it
//     overlaps the computation. Backward rotates K/V the same way and passes each block's K/V
//     gradient sum along with it, so that after cp blocks every owner holds its own.
// Either way only the rank's own q, k, v, output and log-sum-exp are saved for backward: the
// activation memory of attention per rank is 1/cp of one process's.
#pragma once

#include "titan/nn/layers.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace titan::dist {

class Group;

struct ContextParallelOptions {
  bool load_balance = true;           // headtail (true) or contiguous chunks
  std::string rotate = "allgather";  // "allgather" or "alltoall" (the ring)
};

// Throws UserError unless a sequence of seq_len tokens splits evenly: into 2·cp chunks (cp with
// load balancing off), and each rank's part over tp ranks under sequence parallelism. `key` names the
// option in the message.
void check_context_parallel_sequence(int64_t seq_len, int64_t cp, bool load_balance, int64_t tp,
                                     bool sequence_parallel, const char* key = "training.seq_len");

// The options from parallelism.context_parallel_load_balancer / _rotate_method, or a UserError for
// values titan does not run (e.g. "ptrr", which balances per-document flex attention).
ContextParallelOptions context_parallel_options(const std::string& load_balancer, const std::string& rotate_method);

class ContextParallel {
 public:
  ContextParallel(Group& group, ContextParallelOptions options);
  int64_t degree() const;
  int rank() const;
  Group& group() { return group_; }
  const ContextParallelOptions& options() const { return options_; }

  // The global positions (long, seq_len / cp, ascending within each chunk) of the tokens this rank
  // holds of a sequence of seq_len tokens.
  at::Tensor positions(int64_t seq_len) const;
  // This rank's part of x along dimension `dim` (a sequence of x.size(dim) tokens), contiguous.
  at::Tensor shard(const at::Tensor& x, int64_t dim) const;
  // Every rank's parts of x along `dim` put back in global order (collective; for tests and tools).
  at::Tensor unshard(const at::Tensor& x, int64_t dim);

  // Causal attention of this rank's queries q (B, H, S/cp, E) over the keys and values of the whole
  // sequence, given this rank's k, v (B, K, S/cp, E) (K divides H, as in causal_attention); returns
  // (B, H, S/cp, E) in q's dtype. Differentiable in q, k and v; collective over the cp group
  // (forward and backward).
  at::Tensor attention(const at::Tensor& q_BHSE, const at::Tensor& k_BKSE, const at::Tensor& v_BKSE);
  // The same as two halves for per-operator activation checkpointing: the ring forward returning the
  // merged output and its log-sum-exp (fp32), and the ring backward from them (no forward again).
  nn::AttentionKernels attention_kernels();

 private:
  Group& group_;
  ContextParallelOptions options_;
};

}  // namespace titan::dist
