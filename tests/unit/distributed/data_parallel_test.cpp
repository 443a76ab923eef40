// FSDP, HSDP and DDP against the single-process computation, in several processes with Gloo.
//
// Every worker trains a small Llama (vocabulary 130 and 2 KV heads, so some parameters do not
// divide evenly across ranks and need padding) twice: once alone on the whole global batch (the
// reference) and once data-parallel on its own part of it. Gradients, losses after AdamW steps and
// the final parameters must agree to fp32 rounding (relative to each tensor's scale), the
// bytes counted by the collective wrapper must equal the theoretical volume, and sharded state must
// take ~1/N of the memory. Tolerances: losses 1e-5 at every step; gradients 1e-5 at
// the first step (1e-4 later); parameters after 3 AdamW steps within 1% of lr x steps, absolute.
#include "models/tiny_llama.h"
#include "test_util.h"

#include "titan/common/tensor_storage.h"
#include "titan/components/optimizer/optimizer.h"
#include "titan/distributed/ddp.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/mesh.h"
#include "titan/distributed/placement.h"
#include "titan/nn/activation_checkpoint.h"
#include "titan/models/llama3/model.h"
#include "titan/models/common/decoder_parallelize.h"
#include "titan/models/registry.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include <cstdio>
#include <cstdlib>
#include <set>

namespace titan {
namespace {

using namespace std::chrono_literals;

llama3::ModelArgs tiny_args() { return test::tiny_llama(2, 130, 64); }

constexpr int64_t kLocalBatch = 2, kSeqLen = 16, kSteps = 3;

int env_int(const char* name) { return std::atoi(std::getenv(name)); }


TITAN_TEST_WORKER_FN(data_parallel) {
  const int rank = env_int("TITAN_TEST_RANK"), world = env_int("TITAN_TEST_WORLD");
  const int replicate = env_int("TITAN_TEST_REPLICATE"), shard = env_int("TITAN_TEST_SHARD");
  const std::string reshard = std::getenv("TITAN_TEST_RESHARD");
  const std::string ac = std::getenv("TITAN_TEST_AC") ? std::getenv("TITAN_TEST_AC") : "none";
  const auto port = static_cast<uint16_t>(env_int("TITAN_TEST_PORT"));
  at::set_num_threads(1);
  auto store = dist::make_tcp_store("127.0.0.1", port, false, 60s);
  dist::ParallelDims dims(replicate, shard, 1, 1, 1, world);
  dist::Mesh mesh(dims, rank, store, dist::BackendKind::Gloo, 60s);
  const int dp = static_cast<int>(dims.dp_size()), dp_rank = mesh["dp"].rank();

  // The global batches of all steps; this rank reads rows [dp_rank * B, (dp_rank + 1) * B).
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor seq = at::randint(130, {kSteps, dp * kLocalBatch, kSeqLen + 1}, gen, at::kLong);
  const double global_tokens = static_cast<double>(dp * kLocalBatch * kSeqLen);
  auto loss_fn = [&](llama3::Transformer& m, const at::Tensor& s) {
    at::Tensor logits = m->forward(s.slice(1, 0, kSeqLen));
    return at::cross_entropy_loss(logits.flatten(0, 1), s.slice(1, 1, kSeqLen + 1).flatten(0, 1), {},
                                  at::Reduction::Sum) / global_tokens;
  };

  llama3::Transformer ref(tiny_args(), at::TensorOptions()), par(nullptr);
  ref->init_weights(11);
  {
    // The data-parallel model is built without memory; each parameter gets its values once its
    // layout is known (FSDP: each unit's rows of this rank, while being sharded).
    DeferAllocation defer;
    par = llama3::Transformer(tiny_args(), at::TensorOptions());
  }
  std::vector<std::pair<std::string, at::Tensor>> ref_named;
  for (const auto& p : ref->named_parameters()) ref_named.emplace_back(p.key(), p.value());
  const int64_t full_bytes = ref->num_params() * 4;

  // The model's own plan (parallelize_decoder) through the one data-parallel interface: activation
  // checkpointing inside FSDP's (or DDP's) hooks, whose recomputation must communicate nothing more
  // (the counts below are the same as without it); FSDP units: each block, [norm, output], the root.
  dist::DataParallelOptions dpo;
  dpo.fsdp = dist::FSDPOptions{at::kFloat, at::kFloat, reshard};
  dpo.ddp_bucket_bytes = 64 << 10;
  dist::DataParallel data_par(mesh["dp_shard_cp"], mesh["dp_replicate"], dpo,
                        [&](const std::string& name, at::Tensor out, const std::vector<int64_t>& begin) {
                          par->init_region(11, name, out, begin);
                        },
                        mesh.device());
  ParallelizeContext ctx;
  ctx.ac_mode = ac;
  ctx.data_parallel = &data_par;
  parallelize_decoder(*par, ctx);
  dist::FSDP* fsdp = data_par.fsdp();
  dist::DDP* ddp = data_par.ddp();
  TITAN_WORKER_CHECK(data_par.kind() == (dims.fsdp_enabled() ? (dims.dp_replicate_enabled() ? "HSDP" : "FSDP") : "DDP"),
                     "data-parallel kind %s", data_par.kind().c_str());
  std::vector<std::pair<std::string, at::Tensor>> par_named = data_par.named_parameters();
  if (ddp) TITAN_WORKER_CHECK(ddp->num_buckets() > 2, "expected several buckets, got %zu", ddp->num_buckets());
  // FSDP's units: blocks but the last reshard after forward (unless "never": none; "always": every
  // unit, the last block, [norm, output] and the root too).
  auto unit_of = [](const std::string& name) {
    if (name.rfind("layers.", 0) == 0) return name.substr(0, name.find('.', 7));
    return std::string(name.rfind("norm.", 0) == 0 || name.rfind("output.", 0) == 0 ? "head" : "root");
  };
  const std::string last_block = "layers." + std::to_string(tiny_args().n_layers - 1);
  auto reshards = [&](const std::string& unit) {
    return reshard == "always" || (reshard == "default" && unit.rfind("layers.", 0) == 0 && unit != last_block);
  };
  int64_t buffers_per_step = -1, buffers_before = 0;
  OptimizerOptions oo;
  oo.lr = 1e-3;
  Optimizer ref_opt(ref_named, oo), par_opt(par_named, oo);

  double worst_grad = 0, worst_param = 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    at::Tensor global = seq[step];
    ref_opt.zero_grad();
    at::Tensor ref_loss = loss_fn(ref, global);
    ref_loss.backward();

    mesh.reset_bytes();
    par_opt.zero_grad();
    at::Tensor local_loss = loss_fn(par, global.slice(0, dp_rank * kLocalBatch, (dp_rank + 1) * kLocalBatch));
    data_par.before_backward(true);
    local_loss.backward();
    data_par.after_backward(true);
    at::Tensor loss = local_loss.detach().clone();
    mesh["dp"].all_reduce(loss).wait();
    TITAN_WORKER_CHECK(std::abs(loss.item<double>() - ref_loss.item<double>()) <= 1e-5 * ref_loss.item<double>(),
                  "step %lld loss %.8f vs single process %.8f", (long long)step, loss.item<double>(), ref_loss.item<double>());

    // Gradients: the shard's rows of the reference gradient (padding rows zero), or the whole of it.
    std::map<std::string, at::Tensor> ref_grads;
    for (auto& [n, p] : ref_named) ref_grads[n] = p.grad();
    for (auto& [name, p] : par_named) {
      at::Tensor expected = ref_grads.at(name);
      if (fsdp) {
        const int64_t rows = p.size(0), begin = mesh["dp_shard_cp"].rank() * rows;
        at::Tensor padded = at::zeros({rows * mesh["dp_shard_cp"].size(), expected.numel() / expected.size(0)});
        padded.slice(0, 0, expected.size(0)).copy_(expected.reshape({expected.size(0), -1}));
        expected = padded.slice(0, begin, begin + rows).reshape(p.sizes());
      }
      // Step 1 computes from identical parameters; later steps from parameters that already differ
      // by rounding (AdamW normalizes updates, so ~1e-7 differences in small gradient entries move
      // parameters by up to lr), hence the looser bound after the first step.
      const double err = test::relative_error(p.grad(), expected), tol = step == 0 ? 1e-5 : 1e-4;
      worst_grad = std::max(worst_grad, err);
      TITAN_WORKER_CHECK(err <= tol, "step %lld gradient of %s differs by %.3g", (long long)step, name.c_str(), err);
    }

    // The global gradient norm read from the placements equals the single process's.
    const std::vector<dist::PlacedTensor>& placed = data_par.parameters();
    std::vector<at::Tensor> ref_params;
    for (auto& [n, p] : ref_named) ref_params.push_back(p);
    const double ref_norm = clip_grad_norm(ref_params, 0.0), norm = dist::global_grad_norm(placed, mesh);
    TITAN_WORKER_CHECK(std::abs(norm - ref_norm) <= 1e-5 * ref_norm, "step %lld gradient norm %.8f vs single process %.8f",
                       (long long)step, norm, ref_norm);

    // Communication of this step: volume (bytes of the full buffers, see mesh.h) and calls. FSDP
    // issues one all-gather per unit for forward, one more for backward if it resharded, one
    // reduce-scatter per unit and, under HSDP, one all-reduce per unit over the replicas.
    if (fsdp) {
      int64_t gathered = 0, reduced = 0, gathers = 0;
      std::set<std::string> units;
      for (auto& [name, p] : par_named) {
        const int64_t padded_bytes = p.numel() * mesh["dp_shard_cp"].size() * 4;
        const std::string unit = unit_of(name);
        gathered += padded_bytes * (reshards(unit) ? 2 : 1);  // forward, and again for backward if freed
        reduced += padded_bytes;
        if (units.insert(unit).second) gathers += reshards(unit) ? 2 : 1;
      }
      const int64_t n_units = static_cast<int64_t>(units.size());
      TITAN_WORKER_CHECK(n_units == static_cast<int64_t>(par->layers->size()) + 2 &&
                         static_cast<int64_t>(fsdp->num_units()) == n_units, "%lld units", (long long)n_units);
      const auto& bytes = mesh.bytes().at("dp_shard_cp");
      const auto& calls = mesh.calls().at("dp_shard_cp");
      TITAN_WORKER_CHECK(bytes.at("all_gather") == gathered, "all-gather moved %lld bytes, expected %lld",
                    (long long)bytes.at("all_gather"), (long long)gathered);
      TITAN_WORKER_CHECK(bytes.at("reduce_scatter") == reduced, "reduce-scatter moved %lld bytes, expected %lld",
                    (long long)bytes.at("reduce_scatter"), (long long)reduced);
      TITAN_WORKER_CHECK(calls.at("all_gather") == gathers, "%lld all-gathers, expected %lld",
                         (long long)calls.at("all_gather"), (long long)gathers);
      TITAN_WORKER_CHECK(calls.at("reduce_scatter") == n_units, "%lld reduce-scatters, expected one per unit (%lld)",
                         (long long)calls.at("reduce_scatter"), (long long)n_units);
      TITAN_WORKER_CHECK(calls.size() == 3 && calls.at("all_reduce") == 1,
                         "the shard group saw more than the unit collectives and the gradient norm's all-reduce");
      if (dims.dp_replicate_enabled()) {
        TITAN_WORKER_CHECK(mesh.bytes().at("dp_replicate").at("all_reduce") == reduced / mesh["dp_shard_cp"].size(),
                      "HSDP all-reduce volume");
        TITAN_WORKER_CHECK(mesh.calls().at("dp_replicate").at("all_reduce") == n_units, "%lld HSDP all-reduces, expected %lld",
                           (long long)mesh.calls().at("dp_replicate").at("all_reduce"), (long long)n_units);
      }
      // Communication buffers: reused within a step, given back to the allocator when its backward
      // ends (none left pooled), the same number taken every step.
      const int64_t taken = fsdp->buffer_allocations() - buffers_before;
      buffers_before = fsdp->buffer_allocations();
      if (step == 0) buffers_per_step = taken;
      TITAN_WORKER_CHECK(taken == buffers_per_step && taken < 3 * static_cast<int64_t>(fsdp->num_units()),
                         "step %lld took %lld communication buffers (step 1: %lld, units %zu)", (long long)step,
                         (long long)taken, (long long)buffers_per_step, fsdp->num_units());
      TITAN_WORKER_CHECK(fsdp->pooled_bytes() == 0, "%lld bytes of buffers stay pooled after the backward",
                         (long long)fsdp->pooled_bytes());
    } else {
      TITAN_WORKER_CHECK(mesh.bytes().at("dp_replicate").at("all_reduce") == full_bytes, "DDP all-reduce moved %lld bytes",
                    (long long)mesh.bytes().at("dp_replicate").at("all_reduce"));
    }
    ref_opt.step();
    par_opt.step();
  }

  // Gradient reductions in flight never hold more than one unit's padded full-size gradients.
  if (fsdp) {
    std::map<std::string, int64_t> unit_bytes;
    for (auto& [name, p] : par_named) unit_bytes[unit_of(name)] += p.numel() * mesh["dp_shard_cp"].size() * 4;
    int64_t largest = 0;
    for (auto& [u, b] : unit_bytes) largest = std::max(largest, b);
    TITAN_WORKER_CHECK(fsdp->peak_reduction_bytes() > 0 && fsdp->peak_reduction_bytes() <= largest,
                  "reduce-scatter buffers peaked at %lld bytes, one unit holds at most %lld",
                  (long long)fsdp->peak_reduction_bytes(), (long long)largest);
  }

  // Persistent memory: parameters + gradients + AdamW state.
  int64_t local_bytes = 0;
  for (auto& [name, p] : par_named) local_bytes += p.numel() * 4 * 4;
  const double ratio = static_cast<double>(local_bytes) / static_cast<double>(full_bytes * 4);
  const double expected_ratio = 1.0 / (fsdp ? mesh["dp_shard_cp"].size() : 1);
  TITAN_WORKER_CHECK(ratio >= expected_ratio && ratio <= expected_ratio * 1.05, "memory ratio %.4f, expected ~%.4f", ratio,
                expected_ratio);

  // After the steps the parameters equal the single-process ones.
  std::map<std::string, at::Tensor> final_params;
  for (const auto& p : data_par.parameters()) final_params[p.name] = dist::gather_full(p, mesh);
  for (auto& [name, p] : ref_named) {
    // AdamW moves each entry by about lr per step whatever the gradient's size, so rounding
    // differences in near-zero gradient entries show up as absolute differences of a fraction of lr:
    // the bound is 1% of the largest total movement (lr x steps).
    const double err = (final_params.at(name) - p.detach()).abs().max().item<double>();
    worst_param = std::max(worst_param, err);
    TITAN_WORKER_CHECK(err <= 0.01 * oo.lr * kSteps, "parameter %s after %lld steps differs by %.3g", name.c_str(),
                  (long long)kSteps, err);
  }
  std::printf("rank %d: %s matches the single process (worst gradient %.2e, worst final parameter %.2e, "
              "memory ratio %.4f)\n", rank, dims.describe().c_str(), worst_grad, worst_param, ratio);
  return 0;
}

void run_layout(int world, int replicate, int shard, const std::string& reshard = "default", const std::string& ac = "none") {
  auto server = dist::make_tcp_store("127.0.0.1", 0, true, 60s);
  auto results = test::run_workers("data_parallel", world,
                                   {{"TITAN_TEST_PORT", std::to_string(dist::store_port(server))},
                                    {"TITAN_TEST_WORLD", std::to_string(world)},
                                    {"TITAN_TEST_REPLICATE", std::to_string(replicate)},
                                    {"TITAN_TEST_SHARD", std::to_string(shard)},
                                    {"TITAN_TEST_RESHARD", reshard}, {"TITAN_TEST_AC", ac},
                                    {"OMP_NUM_THREADS", "1"}},
                                   300s);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find("matches the single process"), std::string::npos) << results[r].output;
  }
}

// FSDP over a group of one (a single GPU or CPU process) trains exactly like the plain model:
// gradients, losses and parameters agree after AdamW steps.
void fsdp_world_one(const at::Device& device) {
  dist::ParallelDims dims(1, 1, 1, 1, 1, 1);
  dist::Mesh mesh(dims, 0, c10::make_intrusive<c10d::HashStore>(), dist::BackendKind::Gloo, 10s);
  const auto opts = at::TensorOptions().device(device);
  llama3::Transformer ref(tiny_args(), opts), par(tiny_args(), opts);
  ref->init_weights(3);
  par->init_weights(3);
  dist::FSDP fsdp(mesh["dp_shard_cp"], nullptr, {at::kFloat, at::kFloat, "always"});
  for (const auto& [prefix, block] : par->blocks()) fsdp.fully_shard(*block, prefix);
  fsdp.fully_shard(*par, "");
  std::vector<std::pair<std::string, at::Tensor>> ref_named;
  for (const auto& p : ref->named_parameters()) ref_named.emplace_back(p.key(), p.value());
  Optimizer ref_opt(ref_named, {}), par_opt(fsdp.sharded_parameters(), {});
  at::Tensor seq = at::randint(130, {3, 4, kSeqLen + 1}, at::kLong).to(device);
  for (int step = 0; step < 3; ++step) {
    auto loss = [&](llama3::Transformer& m) {
      return at::cross_entropy_loss(m->forward(seq[step].slice(1, 0, kSeqLen)).flatten(0, 1),
                                    seq[step].slice(1, 1, kSeqLen + 1).flatten(0, 1));
    };
    ref_opt.zero_grad();
    par_opt.zero_grad();
    at::Tensor lr = loss(ref), lp = loss(par);
    lr.backward();
    lp.backward();
    fsdp.finish_backward();
    EXPECT_NEAR(lp.item<double>(), lr.item<double>(), 1e-6 * lr.item<double>()) << "step " << step;
    auto ref_params = ref->named_parameters();
    for (auto& [name, shard] : fsdp.sharded_parameters())
      EXPECT_LT(test::relative_error(shard.grad(), ref_params[name].grad()), 1e-6) << name;
    ref_opt.step();
    par_opt.step();
  }
  std::map<std::string, at::Tensor> full;
  for (const auto& p : fsdp.placed_parameters()) full[p.name] = dist::gather_full(p, mesh);
  for (const auto& p : ref->named_parameters()) EXPECT_LT(test::relative_error(full.at(p.key()), p.value()), 1e-6) << p.key();
}

TEST(DataParallel, FsdpWorldOneEqualsThePlainModelOnCpu) { fsdp_world_one(at::kCPU); }

TEST(DataParallel, FsdpWorldOneEqualsThePlainModelOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device visible: FSDP on a GPU runs only on a GPU machine";
  fsdp_world_one(at::Device(at::kCUDA, 0));
}

TEST(DataParallel, Fsdp2) { run_layout(2, 1, 2); }
TEST(DataParallel, Fsdp2WithActivationCheckpointing) { run_layout(2, 1, 2, "default", "full"); }
TEST(DataParallel, Fsdp2WithPerOperatorActivationCheckpointing) { run_layout(2, 1, 2, "default", "op"); }
TEST(DataParallel, Ddp2WithActivationCheckpointing) { run_layout(2, 2, 1, "default", "full"); }
TEST(DataParallel, Fsdp4ReshardAlways) { run_layout(4, 1, 4, "always"); }
TEST(DataParallel, Fsdp2ReshardNever) { run_layout(2, 1, 2, "never"); }
TEST(DataParallel, Hsdp2x2) { run_layout(4, 2, 2); }
TEST(DataParallel, Ddp2) { run_layout(2, 2, 1); }

}  // namespace
}  // namespace titan

namespace titan {
namespace {

// A parameter that gets no gradient on one rank only (a branch that rank did not take) must not make
// the ranks disagree on FSDP's collectives: the unit still reduces, at the same point of the
// backward, and its gradient is the other ranks' sum. Units: inner (in, 16 -> 32, two branches),
// outer (32 -> 8, two branches; rank 1 skips branch b), root (a scale). Different unit sizes make a
// mismatched order fail loudly instead of mixing gradients.
struct Branches : nn::HookedModule {
  nn::Linear a{nullptr}, b{nullptr};
  bool skip_b = false;
  Branches(int64_t in, int64_t out) {
    a = register_module("a", nn::Linear(in, out, at::TensorOptions()));
    b = register_module("b", nn::Linear(in, out, at::TensorOptions()));
  }
  at::Tensor forward(const at::Tensor& x) {
    return with_hooks({x}, [this](const std::vector<at::Tensor>& in) {
      at::Tensor y = a(in[0]);
      return skip_b ? y : y + b(in[0]);
    });
  }
};

struct Net : nn::HookedModule {
  std::shared_ptr<Branches> inner, outer;
  at::Tensor scale;
  Net() {
    inner = register_module("inner", std::make_shared<Branches>(16, 32));
    outer = register_module("outer", std::make_shared<Branches>(32, 8));
    scale = register_parameter("scale", at::ones({8}));
  }
  at::Tensor forward(const at::Tensor& x) {
    return with_hooks([&] { return outer->forward(inner->forward(x).tanh()) * scale; });
  }
};

void init_branches(Net& n) {
  at::NoGradGuard g;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(3);
  for (auto& p : n.parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.3);
}

at::Tensor branches_input() {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(9);
  return at::randn({2, 4, 16}, gen);
}

// Both ranks' losses (rank 1 without outer.b) in one process: the gradients the ranks must sum to.
void branches_reference(Net& ref, const at::Tensor& x) {
  init_branches(ref);
  for (int r = 0; r < 2; ++r) {
    ref.outer->skip_b = r == 1;
    ref.forward(x[r]).square().sum().backward();
  }
}

TITAN_TEST_WORKER_FN(fsdp_unused_on_one_rank) {
  const int rank = env_int("TITAN_TEST_RANK");
  at::set_num_threads(1);
  auto store = dist::make_tcp_store("127.0.0.1", static_cast<uint16_t>(env_int("TITAN_TEST_PORT")), false, 60s);
  dist::ParallelDims dims(1, 2, 1, 1, 1, 2);
  dist::Mesh mesh(dims, rank, store, dist::BackendKind::Gloo, 20s);  // a mismatch fails within 20 s
  const at::Tensor x = branches_input();  // rank r uses x[r]
  // The reference: both ranks' losses (rank 1 without outer.b) in one process.
  Net ref;
  branches_reference(ref, x);
  Net par;
  init_branches(par);
  par.outer->skip_b = rank == 1;
  dist::FSDP fsdp(mesh["dp_shard_cp"], nullptr, dist::FSDPOptions{});
  fsdp.fully_shard(*par.inner, "inner.");
  fsdp.fully_shard(*par.outer, "outer.");
  fsdp.fully_shard(par, "");
  for (int step = 0; step < 2; ++step) {  // twice: the per-backward state is reset
    for (auto& [n, p] : fsdp.sharded_parameters()) p.mutable_grad() = at::Tensor();
    par.forward(x[rank]).square().sum().backward();
    fsdp.finish_backward();
    auto ref_params = ref.named_parameters();
    for (const auto& p : fsdp.placed_parameters()) {
      const at::Tensor grad = dist::gather_full({p.name, p.local.grad(), p.placement}, mesh);
      const double err = test::relative_error(grad, ref_params[p.name].grad());
      TITAN_WORKER_CHECK(err < 1e-6, "step %d gradient of %s differs by %.3g", step, p.name.c_str(), err);
    }
  }
  std::printf("rank %d: same collectives, right gradients\n", rank);
  return 0;
}

// The same for DDP, one bucket per parameter: the buckets holding outer.b (unused on rank 1) are
// all-reduced by rank 1 at the end of its backward, after the buckets before them, so both ranks
// issue every bucket in one order (Gloo, like NCCL, matches collectives by order).
TITAN_TEST_WORKER_FN(ddp_unused_on_one_rank) {
  const int rank = env_int("TITAN_TEST_RANK");
  at::set_num_threads(1);
  auto store = dist::make_tcp_store("127.0.0.1", static_cast<uint16_t>(env_int("TITAN_TEST_PORT")), false, 60s);
  dist::ParallelDims dims(2, 1, 1, 1, 1, 2);
  dist::Mesh mesh(dims, rank, store, dist::BackendKind::Gloo, 20s);  // a mismatch fails within 20 s
  const at::Tensor x = branches_input();  // rank r uses x[r]
  Net ref;
  branches_reference(ref, x);
  Net par;
  init_branches(par);
  par.outer->skip_b = rank == 1;
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& p : par.named_parameters()) named.emplace_back(p.key(), p.value());
  dist::DDP ddp(named, mesh["dp_replicate"], /*bucket_bytes=*/1);
  TITAN_WORKER_CHECK(ddp.num_buckets() == named.size(), "one bucket per parameter, got %zu", ddp.num_buckets());
  auto ref_params = ref.named_parameters();
  for (int step = 0; step < 2; ++step) {  // twice: the per-backward state is reset
    for (auto& [n, p] : named) p.mutable_grad() = at::Tensor();
    par.forward(x[rank]).square().sum().backward();
    ddp.finish_backward();
    for (const auto& [n, p] : named) {
      TITAN_WORKER_CHECK(p.grad().defined(), "step %d: %s has no gradient", step, n.c_str());
      const double err = test::relative_error(p.grad(), ref_params[n].grad());
      TITAN_WORKER_CHECK(err < 1e-6, "step %d gradient of %s differs by %.3g", step, n.c_str(), err);
    }
  }
  std::printf("rank %d: same collectives, right gradients\n", rank);
  return 0;
}

// Runs a two-rank worker above and checks both ranks report the same collectives and right gradients.
void expect_same_collectives_and_gradients(const std::string& worker) {
  auto server = dist::make_tcp_store("127.0.0.1", 0, true, 60s);
  auto results = test::run_workers(worker, 2,
                                   {{"TITAN_TEST_PORT", std::to_string(dist::store_port(server))}, {"OMP_NUM_THREADS", "1"}},
                                   120s);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find("right gradients"), std::string::npos) << results[r].output;
  }
}

TEST(DataParallel, DdpWithAParameterUnusedOnOneRankIssuesTheSameCollectives) {
  expect_same_collectives_and_gradients("ddp_unused_on_one_rank");
}

TEST(DataParallel, FsdpWithAParameterUnusedOnOneRankIssuesTheSameCollectives) {
  expect_same_collectives_and_gradients("fsdp_unused_on_one_rank");
}

}  // namespace
}  // namespace titan
