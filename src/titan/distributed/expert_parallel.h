// Expert parallelism (torchtitan's all-to-all token dispatch): the routed experts of every MoE layer
// are split over the "ep" mesh dimension, each rank holding E / ep of them (experts
// [rank * E/ep, (rank + 1) * E/ep)), and every routed copy of a token travels to the rank that holds
// its expert and back.
//
// One MoE layer's exchange, for this rank's routed copies sorted by expert (N, D) with counts (E):
//   1. the counts go first: an all-to-all of the (E) counts, E/ep to each rank; rank r receives
//      (ep, E/ep): how many copies each rank sends to each of r's experts;
//   2. the counts are read on the host (the row splits of the token all-to-all: one host read per
//      layer and step, as torchtitan's dispatch makes);
//   3. the copies' all-to-all: rows go to their expert's rank, arriving grouped by source rank;
//   4. a permutation regroups them by local expert (each expert's rows from rank 0, 1, ...), the
//      order the grouped matrix multiplications read;
//   back: the inverse permutation, then the reverse all-to-all (the splits swapped) returns every
//   output to the rank and the place its copy came from.
// Both all-to-alls are autograd functions whose backward is the reverse all-to-all of the
// gradients. Bytes are counted on "ep" as "all_to_all" (the rows that cross between ranks).
//
// Gradients: an expert's weight gets, through the exchange, the gradients of every copy routed to
// it on the ep ranks; the ranks holding the same experts ("efsdp", and the replicas) sum them as
// the data-parallel layer does for every parameter (the experts' FSDP runs over "efsdp").
#pragma once

#include "titan/distributed/mesh.h"
#include "titan/distributed/placement.h"
#include "titan/nn/moe.h"

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace titan::dist {

class ExpertParallel {
 public:
  explicit ExpertParallel(Group& ep) : group_(ep) {}
  int64_t degree() const { return group_.size(); }
  Group& group() { return group_; }

  // Keeps this rank's experts (dim 0 of w1, w2, w3) and returns their placements (a Shard over
  // "ep"). Throws UserError when the degree does not divide the number of experts.
  std::vector<std::pair<std::string, Placement>> shard(nn::GroupedExpertsImpl& experts) const;
  // The exchange above, for a MoE layer whose experts were sharded here (nn::MoEImpl::exchange).
  // On the meta device (titan estimate's dry run, where the router has no values) the routing is
  // taken as balanced: every rank sends 1/ep of its copies to each rank and receives as many.
  nn::ExpertExchange exchange(const at::Tensor& routed_ND, const at::Tensor& counts_E);

 private:
  nn::ExpertExchange balanced_exchange(const at::Tensor& routed_ND, const at::Tensor& counts_E);
  Group& group_;
};

// Sums, in place, per-expert routing figures of MoE layers (counts, auxiliary-loss terms) over the
// ranks that routed other tokens of the same batch: data and context parallel (the expert-parallel
// ranks are among them), and tensor parallel under sequence parallelism, where each tensor-parallel
// rank routes its part of the sequence (`sequence_parallel_tp`; null otherwise, when every
// tensor-parallel rank routes the same tokens).
void sum_routing_figures(at::Tensor& figures, Group& dp_cp, Group* sequence_parallel_tp);

// A MoE layer's global_counts (nn::MoEImpl): its counts summed as above, into a new tensor.
std::function<at::Tensor(const at::Tensor&)> routing_counts_sum(Group& dp_cp, Group* sequence_parallel_tp);

}  // namespace titan::dist
