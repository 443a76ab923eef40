// c10d proof: two processes rendezvous through a TCPStore on loopback and run Gloo collectives
// on CPU tensors; every result is checked against the value computed by hand.
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/distributed/mesh.h"
#include "titan/distributed/process_group.h"
#include "titan/distributed/runtime.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include <stdlib.h>

namespace titan {
namespace {

using namespace std::chrono_literals;


TITAN_TEST_WORKER_FN(gloo_collectives) {
  const int rank = std::atoi(std::getenv("TITAN_TEST_RANK"));
  const int world = 2;
  const auto port = static_cast<uint16_t>(std::atoi(std::getenv("TITAN_TEST_PORT")));
  auto store = dist::make_tcp_store("127.0.0.1", port, /*is_server=*/false, 30s);
  auto pg = dist::make_backend(dist::BackendKind::Gloo, store, rank, world, 30s);

  // all-reduce (sum): rank r contributes (r + 1) * [1, 2, 3, 4] -> 3 * [1, 2, 3, 4]
  std::vector<at::Tensor> t{at::arange(1, 5, at::kFloat) * (rank + 1)};
  pg->allreduce(t)->wait();
  TITAN_WORKER_CHECK(at::equal(t[0], at::arange(1, 5, at::kFloat) * 3));

  // all-gather: each rank contributes [r, r] -> [[0, 0], [1, 1]] on every rank
  std::vector<at::Tensor> in{at::full({2}, rank, at::kFloat)};
  std::vector<std::vector<at::Tensor>> out{{at::empty({2}), at::empty({2})}};
  pg->allgather(out, in)->wait();
  for (int r = 0; r < world; ++r) TITAN_WORKER_CHECK(at::equal(out[0][r], at::full({2}, r, at::kFloat)));

  // reduce-scatter (sum): rank r contributes chunks c_k = 10 k + r; rank k receives sum_r c_k
  std::vector<at::Tensor> chunks_in{at::full({3}, 10 * 0 + rank, at::kFloat), at::full({3}, 10 * 1 + rank, at::kFloat)};
  std::vector<std::vector<at::Tensor>> rs_in{chunks_in};
  std::vector<at::Tensor> rs_out{at::empty({3})};
  pg->reduce_scatter(rs_out, rs_in)->wait();
  TITAN_WORKER_CHECK(at::equal(rs_out[0], at::full({3}, 2 * 10 * rank + 0 + 1, at::kFloat)));

  // send / recv: rank 0 sends [7, 8, 9] to rank 1
  if (rank == 0) {
    std::vector<at::Tensor> msg{at::arange(7, 10, at::kFloat)};
    pg->send(msg, 1, /*tag=*/0)->wait();
  } else {
    std::vector<at::Tensor> msg{at::zeros({3})};
    pg->recv(msg, 0, /*tag=*/0)->wait();
    TITAN_WORKER_CHECK(at::equal(msg[0], at::arange(7, 10, at::kFloat)));
  }
  pg->barrier()->wait();
  std::printf("rank %d: all collectives correct\n", rank);
  return 0;
}

TEST(C10d, GlooCollectivesAcrossTwoProcesses) {
  // This process hosts the store on a free port; the two workers connect to it as clients.
  auto server = dist::make_tcp_store("127.0.0.1", 0, /*is_server=*/true, 30s);
  const uint16_t port = dist::store_port(server);
  ASSERT_GT(port, 0);
  auto results = test::run_workers("gloo_collectives", 2, {{"TITAN_TEST_PORT", std::to_string(port)}}, 120s);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_FALSE(results[r].timed_out) << "rank " << r << " timed out:\n" << results[r].output;
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find("all collectives correct"), std::string::npos) << results[r].output;
  }
}

// The trainer shortens the collective timeout after the first step (comm.train_timeout_seconds):
// a collective that a rank never joins then fails after the new timeout, not the initial one.
TITAN_TEST_WORKER_FN(gloo_timeout) {
  const int rank = std::atoi(std::getenv("TITAN_TEST_RANK"));
  const auto port = static_cast<uint16_t>(std::atoi(std::getenv("TITAN_TEST_PORT")));
  auto store = dist::make_tcp_store("127.0.0.1", port, /*is_server=*/false, 60s);
  dist::ParallelDims dims(1, 2, 1, 1, 1, 2);
  dist::Mesh mesh(dims, rank, store, dist::BackendKind::Gloo, 60s);
  at::Tensor t = at::ones({4});
  mesh["dp_shard"].all_reduce(t).wait();  // both ranks: completes
  mesh.set_timeout(2s);
  if (rank == 1) {
    std::this_thread::sleep_for(12s);  // never joins the next collective in time
    return 0;
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    mesh["dp_shard"].all_reduce(t).wait();
    std::printf("rank 0: the collective completed without rank 1\n");
    return 1;
  } catch (const std::exception& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("rank 0: timed out after %.1f s\n", s);
    return s < 10 ? 0 : 1;
  }
}

TEST(C10d, ShortenedTimeoutAppliesToLaterCollectives) {
  auto server = dist::make_tcp_store("127.0.0.1", 0, /*is_server=*/true, 60s);
  auto results = test::run_workers("gloo_timeout", 2, {{"TITAN_TEST_PORT", std::to_string(dist::store_port(server))}},
                                   120s);
  EXPECT_EQ(results[0].exit_code, 0) << results[0].output;
  EXPECT_NE(results[0].output.find("timed out after"), std::string::npos) << results[0].output;
}

// GLOO_SOCKET_IFNAME chooses Gloo's network interfaces (multi-node CPU runs where the host name
// resolves to a loopback): a usable one works, an unknown one is a clear error naming it.
TEST(C10d, GlooSocketIfnameChoosesTheInterface) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  ::setenv("GLOO_SOCKET_IFNAME", "lo", 1);
  EXPECT_NO_THROW(dist::make_backend(dist::BackendKind::Gloo, store, 0, 1, 10s));
  ::setenv("GLOO_SOCKET_IFNAME", "titan-no-such-if0", 1);
  try {
    dist::make_backend(dist::BackendKind::Gloo, store, 0, 1, 10s);
    ADD_FAILURE() << "an unknown interface was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("GLOO_SOCKET_IFNAME names the network interface 'titan-no-such-if0'"),
              std::string::npos)
        << e.what();
  }
  ::unsetenv("GLOO_SOCKET_IFNAME");
}

// Under torchrun's agent store every worker is a client and its keys live under the restart
// attempt's prefix, as PyTorch's workers' do: a restarted job never reads the last attempt's keys.
TEST(C10d, AgentStoreKeysArePrefixedWithTheRestartAttempt) {
  auto server = dist::make_tcp_store("127.0.0.1", 0, /*is_server=*/true, 30s);
  dist::LaunchEnv env;
  env.rank = 0;  // rank 0 too is a client of the agent's store
  env.world_size = 2;
  env.master_port = dist::store_port(server);
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "3", 1);
  auto store = dist::connect_store(env, 30s);
  store->set("nccl_id", std::vector<uint8_t>{1, 2, 3});
  EXPECT_TRUE(server->check({"/worker/attempt_3/nccl_id"}));
  EXPECT_FALSE(server->check({"nccl_id"}));
  ::unsetenv("TORCHELASTIC_USE_AGENT_STORE");
  ::unsetenv("TORCHELASTIC_RESTART_COUNT");
  // Outside the agent, keys are unprefixed (rank 1 here: a client).
  env.rank = 1;
  dist::connect_store(env, 30s)->set("plain", std::vector<uint8_t>{4});
  EXPECT_TRUE(server->check({"plain"}));
}

TEST(C10d, NcclBackendIsLinkedIn) {
  // With a CUDA libtorch, ProcessGroupNCCL is part of this binary: on a GPU machine a one-rank group
  // all-reduces a CUDA tensor; without a GPU, constructing it reaches NCCL's own device check.
  ASSERT_TRUE(dist::nccl_compiled()) << "libtorch was found without CUDA, so titan has no NCCL backend";
  auto store = c10::make_intrusive<c10d::HashStore>();
  if (torch::cuda::is_available()) {
    auto pg = dist::make_backend(dist::BackendKind::NCCL, store, 0, 1, 30s);
    std::vector<at::Tensor> t{at::ones({4}, at::TensorOptions().device(at::kCUDA))};
    pg->allreduce(t)->wait();
    EXPECT_TRUE(at::equal(t[0].cpu(), at::ones({4})));
  } else {
    try {
      dist::make_backend(dist::BackendKind::NCCL, store, 0, 1, 5s);
      FAIL() << "NCCL backend constructed without a GPU";
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find("GPU"), std::string::npos) << e.what();
    }
  }
}

TEST(C10d, UnreachableStoreIsAClearError) {
  // Nothing listens on port 1 of loopback: the client gives up after its timeout with advice.
  try {
    dist::make_tcp_store("127.0.0.1", 1, /*is_server=*/false, 2s);
    FAIL() << "connecting to a closed port succeeded";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace titan
