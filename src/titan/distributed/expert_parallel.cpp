#include "titan/distributed/expert_parallel.h"

#include "titan/common/error.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

namespace titan::dist {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor exchange_rows(const at::Tensor& x, Group& g, const std::vector<int64_t>& out_splits,
                         const std::vector<int64_t>& in_splits) {
  int64_t rows = 0;
  for (int64_t s : out_splits) rows += s;
  std::vector<int64_t> shape = x.sizes().vec();
  shape[0] = rows;
  at::Tensor out = at::empty(shape, x.options());
  g.all_to_all(out, x.contiguous(), out_splits, in_splits).wait();
  return out;
}

// Rows of x to the ranks in_splits says, rows from them as out_splits says; backward: the reverse.
struct AllToAllFn : public torch::autograd::Function<AllToAllFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group, std::vector<int64_t> out_splits,
                            std::vector<int64_t> in_splits) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["out_splits"] = out_splits;
    ctx->saved_data["in_splits"] = in_splits;
    return exchange_rows(x, *reinterpret_cast<Group*>(group), out_splits, in_splits);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Group& g = *reinterpret_cast<Group*>(ctx->saved_data["group"].toInt());
    const std::vector<int64_t> out_splits = ctx->saved_data["out_splits"].toIntVector();
    const std::vector<int64_t> in_splits = ctx->saved_data["in_splits"].toIntVector();
    return {exchange_rows(grads[0], g, in_splits, out_splits), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor all_to_all_rows(const at::Tensor& x, Group& g, const std::vector<int64_t>& out_splits,
                           const std::vector<int64_t>& in_splits) {
  return AllToAllFn::apply(x, reinterpret_cast<int64_t>(&g), out_splits, in_splits);
}

}  // namespace

std::vector<std::pair<std::string, Placement>> ExpertParallel::shard(nn::GroupedExpertsImpl& experts) const {
  const int64_t E = experts.w1.size(0), n = group_.size();
  TITAN_USER_CHECK(E % n == 0, "parallelism.expert_parallel_degree ", n, " does not divide the model's ", E,
                   " routed experts: each expert-parallel rank holds the same number of experts; choose a degree "
                   "that divides ", E);
  return {{"w1", shard_in_place(experts.w1, 0, group_.name(), group_.rank(), group_.size())},
          {"w2", shard_in_place(experts.w2, 0, group_.name(), group_.rank(), group_.size())},
          {"w3", shard_in_place(experts.w3, 0, group_.name(), group_.rank(), group_.size())}};
}

nn::ExpertExchange ExpertParallel::exchange(const at::Tensor& routed_ND, const at::Tensor& counts_E) {
  const int64_t n = group_.size(), E = counts_E.numel(), e = E / n;
  TITAN_ASSERT(E % n == 0, "expert exchange: ", E, " experts over ", n, " ranks");
  if (routed_ND.is_meta()) return balanced_exchange(routed_ND, counts_E);
  at::Tensor sent_E, recv_E;
  {
    at::NoGradGuard no_grad;
    sent_E = counts_E.to(at::kLong).contiguous();
    recv_E = at::empty_like(sent_E);
    group_.all_to_all(recv_E, sent_E, std::vector<int64_t>(n, e), std::vector<int64_t>(n, e)).wait();
  }
  // The one host read of the layer: both count vectors.
  const at::Tensor host = at::cat({sent_E, recv_E}).to(at::kCPU);
  const int64_t* c = host.data_ptr<int64_t>();
  std::vector<int64_t> in_splits(n, 0), out_splits(n, 0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < e; ++j) {
      in_splits[r] += c[r * e + j];
      out_splits[r] += c[E + r * e + j];
    }
  int64_t rows = 0;
  for (int64_t s : out_splits) rows += s;

  // Arrived rows are grouped by source rank, then local expert: block (r, j) of recv[r, j] rows.
  // Grouped by local expert instead, block (j, r) of the same rows: row p of block (j, r) is row
  // p - start_by_expert(j, r) + start_by_rank(r, j) of what arrived.
  at::Tensor take_M;
  {
    at::NoGradGuard no_grad;
    const at::Tensor recv_RE = recv_E.view({n, e});
    const at::Tensor start_by_rank = (at::cumsum(recv_E, 0) - recv_E).view({n, e}).t().reshape({-1});
    const at::Tensor sizes_by_expert = recv_RE.t().reshape({-1});
    const at::Tensor start_by_expert = at::cumsum(sizes_by_expert, 0) - sizes_by_expert;
    const at::Tensor block_M = at::repeat_interleave(at::arange(n * e, recv_E.options()), sizes_by_expert, 0, rows);
    take_M = (start_by_rank - start_by_expert).index_select(0, block_M) + at::arange(rows, recv_E.options());
  }
  const at::Tensor arrived = all_to_all_rows(routed_ND, group_, out_splits, in_splits);
  nn::ExpertExchange ex;
  ex.x_ND = arrived.index_select(0, take_M.to(arrived.device()));
  ex.counts_E = recv_E.view({n, e}).sum(0).to(routed_ND.device());
  Group* g = &group_;
  ex.back = [g, take_M, in_splits, out_splits](const at::Tensor& out_MD) {
    at::Tensor put_M;
    {
      at::NoGradGuard no_grad;
      put_M = at::empty_like(take_M).scatter_(0, take_M, at::arange(take_M.numel(), take_M.options()));
    }
    const at::Tensor by_rank = out_MD.index_select(0, put_M.to(out_MD.device()));
    return all_to_all_rows(by_rank, *g, in_splits, out_splits);
  };
  return ex;
}

nn::ExpertExchange ExpertParallel::balanced_exchange(const at::Tensor& routed_ND, const at::Tensor& counts_E) {
  // The same collectives and tensors as the exchange above, with the rows spread evenly: every rank
  // sends 1/ep of its copies to each rank and receives as many.
  const int64_t n = group_.size(), e = counts_E.numel() / n, N = routed_ND.size(0);
  at::Tensor recv_E = at::empty_like(counts_E);
  group_.all_to_all(recv_E, counts_E, std::vector<int64_t>(n, e), std::vector<int64_t>(n, e)).wait();
  std::vector<int64_t> splits(n);
  for (int64_t r = 0; r < n; ++r) splits[r] = N / n + (r < N % n ? 1 : 0);
  const at::Tensor order = at::arange(N, routed_ND.options().dtype(at::kLong));
  nn::ExpertExchange ex;
  ex.x_ND = all_to_all_rows(routed_ND, group_, splits, splits).index_select(0, order);
  ex.counts_E = at::empty({e}, counts_E.options());
  Group* g = &group_;
  ex.back = [g, order, splits](const at::Tensor& out_MD) {
    return all_to_all_rows(out_MD.index_select(0, order), *g, splits, splits);
  };
  return ex;
}

void sum_routing_figures(at::Tensor& figures, Group& dp_cp, Group* sequence_parallel_tp) {
  dp_cp.all_reduce(figures).wait();
  if (sequence_parallel_tp) sequence_parallel_tp->all_reduce(figures).wait();
}

std::function<at::Tensor(const at::Tensor&)> routing_counts_sum(Group& dp_cp, Group* sequence_parallel_tp) {
  return [&dp_cp, sequence_parallel_tp](const at::Tensor& counts_E) {
    at::Tensor sum = counts_E.clone();
    sum_routing_figures(sum, dp_cp, sequence_parallel_tp);
    return sum;
  };
}

}  // namespace titan::dist
