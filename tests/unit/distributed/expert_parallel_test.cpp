// Expert parallelism (distributed/expert_parallel.h) in several processes with Gloo: a MoE layer whose
// experts are split over ep ranks, each rank routing its own tokens, against the whole layer run on
// every rank's tokens in one process. Outputs, input gradients and the experts' gradients agree to
// 1e-5 relative (fp32; only summation orders differ), the router's gradient once summed over the
// ranks; the bytes counted on "ep" are exactly the counts exchanged plus the routed copies that
// cross between ranks (forward and backward), each D x 4 bytes. A second round steers every token
// away from the last rank's experts (a routing bias), so that rank receives no rows at all.
//
// Also the mesh: which ranks form the ep and efsdp groups, and the degrees that are refused.
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/distributed/expert_parallel.h"
#include "titan/distributed/mesh.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/distributed/process_group.h"
#include "titan/nn/moe.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>

namespace titan {
namespace {

using namespace std::chrono_literals;

int env_int(const char* name) { return std::atoi(std::getenv(name)); }

constexpr int64_t kTokensPerRank = 24, kDim = 16, kHidden = 8, kExperts = 8, kTopK = 2;

nn::MoEOptions options() {
  nn::MoEOptions o;
  o.dim = kDim;
  o.hidden_dim = kHidden;
  o.num_experts = kExperts;
  o.top_k = kTopK;
  o.route_norm = true;
  return o;
}

void fill(nn::MoEImpl& moe, uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::NoGradGuard no_grad;
  for (auto& p : moe.named_parameters()) p.value().copy_(at::randn(p.value().sizes(), gen) * 0.3);
}

TITAN_TEST_WORKER_FN(expert_parallel) {
  const int rank = env_int("TITAN_TEST_RANK"), n = env_int("TITAN_TEST_WORLD");
  at::set_num_threads(1);
  auto store = dist::make_tcp_store("127.0.0.1", static_cast<uint16_t>(env_int("TITAN_TEST_PORT")), false, 60s);
  dist::Mesh mesh(dist::ParallelDims(1, n, 1, 1, 1, n, /*ep=*/n), rank, store, dist::BackendKind::Gloo, 60s);
  dist::ExpertParallel ep(mesh["ep"]);
  const int64_t e = kExperts / n;

  for (const bool starve_last : {false, true}) {
    nn::MoE whole(options(), at::TensorOptions()), split(options(), at::TensorOptions());
    fill(*whole, 3);
    fill(*split, 3);
    if (starve_last) {  // the bias steers the choice only: no token picks the last rank's experts
      whole->expert_bias.slice(0, kExperts - e).fill_(-1e3);
      split->expert_bias.slice(0, kExperts - e).fill_(-1e3);
    }
    const auto placed = ep.shard(*split->experts);
    TITAN_WORKER_CHECK(split->experts->w1.size(0) == e && placed.size() == 3 && placed[0].second.shards[0].offset == rank * e,
                       "rank %d holds %ld experts", rank, static_cast<long>(split->experts->w1.size(0)));
    split->exchange = [&ep](const at::Tensor& x, const at::Tensor& c) { return ep.exchange(x, c); };

    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(9);
    const at::Tensor x_all = at::randn({n, kTokensPerRank, kDim}, gen);
    const at::Tensor w_all = at::randn({n, kTokensPerRank, kDim}, gen);  // the loss: sum(y * w)
    at::Tensor xw = x_all.clone().requires_grad_(true);
    const at::Tensor y_whole = whole->forward(xw.view({1, n * kTokensPerRank, kDim}));
    (y_whole * w_all.view({1, n * kTokensPerRank, kDim})).sum().backward();

    mesh.reset_bytes();
    at::Tensor xs = x_all[rank].clone().requires_grad_(true);
    const at::Tensor y = split->forward(xs.view({1, kTokensPerRank, kDim}));
    (y * w_all[rank].view({1, kTokensPerRank, kDim})).sum().backward();

    const double out_err = test::relative_error(y.view({kTokensPerRank, kDim}), y_whole.view({n, kTokensPerRank, kDim})[rank]);
    const double in_err = test::relative_error(xs.grad(), xw.grad()[rank]);
    TITAN_WORKER_CHECK(out_err < 1e-5 && in_err < 1e-5, "output %g, input gradient %g", out_err, in_err);
    for (const char* w : {"w1", "w2", "w3"}) {
      const at::Tensor mine = split->experts->named_parameters()[w].grad();
      const at::Tensor ref = whole->experts->named_parameters()[w].grad().slice(0, rank * e, (rank + 1) * e);
      const double err = test::relative_error(mine, ref);
      TITAN_WORKER_CHECK(err < 1e-5, "experts %s gradient %g", w, err);
    }
    at::Tensor gate = split->router->gate->weight.grad().clone();
    mesh["world"].all_reduce(gate).wait();
    const double gate_err = test::relative_error(gate, whole->router->gate->weight.grad());
    TITAN_WORKER_CHECK(gate_err < 1e-5, "router gradient summed over ranks %g", gate_err);

    // Bytes: the counts (e int64 to each other rank), then every routed copy that crosses: sent to
    // its expert and its output sent back, in forward and again (the gradients) in backward.
    at::Tensor ids;
    {
      at::NoGradGuard no_grad;
      const nn::Routing r = nn::route(whole->router->forward(x_all.view({-1, kDim})), whole->expert_bias, options());
      ids = r.ids_TK.view({n, kTokensPerRank * kTopK});
    }
    const at::Tensor owner = ids.div(e, "floor");  // the rank holding each copy's expert
    const int64_t sent = owner[rank].ne(rank).sum().item<int64_t>();
    const int64_t received = owner.eq(rank).sum().item<int64_t>() - owner[rank].eq(rank).sum().item<int64_t>();
    const int64_t expected = e * 8 * (n - 1) + 2 * (sent + received) * kDim * 4;
    const int64_t counted = mesh.bytes().at("ep").at("all_to_all");
    TITAN_WORKER_CHECK(counted == expected, "all_to_all bytes %ld, expected %ld", static_cast<long>(counted),
                       static_cast<long>(expected));
    if (starve_last && rank == n - 1)
      TITAN_WORKER_CHECK(owner.eq(rank).sum().item<int64_t>() == 0, "the last rank still receives tokens");
  }
  std::printf("matches the single process\n");
  return 0;
}

void run_ep(int n) {
  auto server = dist::make_tcp_store("127.0.0.1", 0, true, 60s);
  auto results = test::run_workers("expert_parallel", n,
                                   {{"TITAN_TEST_PORT", std::to_string(dist::store_port(server))},
                                    {"TITAN_TEST_WORLD", std::to_string(n)},
                                    {"OMP_NUM_THREADS", "1"}},
                                   180s);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find("matches the single process"), std::string::npos) << results[r].output;
  }
}

TEST(ExpertParallel, TwoRanksEqualTheWholeLayer) { run_ep(2); }
TEST(ExpertParallel, FourRanksEqualTheWholeLayer) { run_ep(4); }

TEST(ExpertParallel, GroupsComeOutOfDpShardTimesCp) {
  // 8 ranks: dp_shard 2 x cp 2 x tp 2, ep 2. dp_shard_cp of rank 0: ranks 0, 2, 4, 6 (tp fastest);
  // ep takes consecutive members (0, 2), efsdp the members ep apart (0, 4).
  const dist::ParallelDims dims(1, 2, 2, 2, 1, 8, 2);
  EXPECT_EQ(dims.group_ranks("dp_shard_cp", 0), (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(dims.group_ranks("ep", 0), (std::vector<int>{0, 2}));
  EXPECT_EQ(dims.group_ranks("ep", 4), (std::vector<int>{4, 6}));
  EXPECT_EQ(dims.group_ranks("efsdp", 2), (std::vector<int>{2, 6}));
  EXPECT_EQ(dims.group_ranks("ep", 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(dims.rank_in("ep", 6), 1);
  EXPECT_EQ(dims.degree("efsdp"), 2);
  EXPECT_NE(dims.describe().find("ep 2"), std::string::npos);
  // ep must divide dp_shard x cp.
  const std::string refused = test::error_of([] { dist::ParallelDims(1, 3, 1, 1, 1, 3, 2); });
  EXPECT_NE(refused.find("expert_parallel_degree 2 does not divide"), std::string::npos) << refused;
  EXPECT_NE(test::error_of([] { dist::ParallelDims(1, 2, 1, 1, 1, 2, 0); }), "");
  // Without EP the groups are one rank (ep) and dp_shard_cp's (efsdp).
  const dist::ParallelDims plain(1, 4, 1, 1, 1, 4);
  EXPECT_EQ(plain.group_ranks("ep", 1), (std::vector<int>{1}));
  EXPECT_EQ(plain.group_ranks("efsdp", 1), (std::vector<int>{0, 1, 2, 3}));
}

}  // namespace
}  // namespace titan
