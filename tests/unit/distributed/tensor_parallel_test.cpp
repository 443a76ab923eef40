// Tensor parallelism (with sequence parallel, loss parallel and async TP, alone and under FSDP or
// DDP) against the single-process computation, in several processes with Gloo.
//
// Every worker trains a small Llama twice: once alone on the whole global batch (the reference)
// and once through parallelize_decoder with the layout under test. Checked at every step: the loss
// (1e-5 relative), every parameter's gradient gathered through its placement (1e-5 of its scale at
// the first step, 1e-4 later: later steps start from parameters that already differ by rounding),
// the global gradient norm, and the bytes each mesh dimension moved against the formulas of
// docs/parallelism.md; after the steps, the parameters (1% of lr x steps, absolute, as AdamW moves
// every entry by about lr per step).
#include "models/tiny_llama.h"
#include "test_util.h"

#include "titan/common/autocast.h"
#include "titan/common/error.h"
#include "titan/common/memory_tracker.h"
#include "titan/common/tensor_storage.h"
#include "titan/components/optimizer/optimizer.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/mesh.h"
#include "titan/distributed/placement.h"
#include "titan/distributed/tensor_parallel.h"
#include "titan/nn/loss.h"
#include "titan/models/llama3/model.h"
#include "titan/models/common/decoder_parallelize.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

namespace titan {
namespace {

using namespace std::chrono_literals;

constexpr int64_t kLocalBatch = 2, kSeqLen = 16, kSteps = 3, kLayers = 2, kVocab = 128;

int env_int(const char* name, int fallback = 0) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

llama3::ModelArgs args_for(int tp, bool tied) {
  llama3::ModelArgs a = test::tiny_llama(kLayers, kVocab, 64);
  a.n_kv_heads = tp > 2 ? 4 : 2;  // tp must divide the KV heads
  a.tie_embeddings = tied;        // 1B and 3B: the output layer is the embedding's (sharded) table
  return a;
}

TITAN_TEST_WORKER_FN(tensor_parallel) {
  const int rank = env_int("TITAN_TEST_RANK"), world = env_int("TITAN_TEST_WORLD");
  const int tp = env_int("TITAN_TEST_TP"), replicate = env_int("TITAN_TEST_REPLICATE", 1);
  const int shard = env_int("TITAN_TEST_SHARD", 1);
  const std::string ac = std::getenv("TITAN_TEST_AC") ? std::getenv("TITAN_TEST_AC") : "none";
  dist::TensorParallelOptions tpo;
  tpo.sequence_parallel = env_int("TITAN_TEST_SP", 1) != 0;
  tpo.loss_parallel = env_int("TITAN_TEST_LOSS_PARALLEL", 1) != 0;
  tpo.async = env_int("TITAN_TEST_ASYNC", 0) != 0;
  // bf16 autocast (what CUDA training without FSDP runs): activations bf16, weights fp32. Both
  // models compute in bf16, so they agree to bf16's rounding of their different summation orders.
  const bool autocast = env_int("TITAN_TEST_AUTOCAST", 0) != 0;
  const double loss_tol = autocast ? 2e-3 : 1e-5, grad_tol = autocast ? 5e-2 : 1e-5;
  at::set_num_threads(1);
  auto store = dist::make_tcp_store("127.0.0.1", static_cast<uint16_t>(env_int("TITAN_TEST_PORT")), false, 60s);
  dist::ParallelDims dims(replicate, shard, 1, tp, 1, world);
  dist::Mesh mesh(dims, rank, store, dist::BackendKind::Gloo, 60s);
  const int dp = static_cast<int>(dims.dp_size()), dp_rank = mesh["dp"].rank();

  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Tensor seq = at::randint(kVocab, {kSteps, dp * kLocalBatch, kSeqLen + 1}, gen, at::kLong);
  const double global_tokens = static_cast<double>(dp * kLocalBatch * kSeqLen);

  const llama3::ModelArgs args = args_for(tp, env_int("TITAN_TEST_TIED", 0) != 0);
  llama3::Transformer ref(args, at::TensorOptions()), par(nullptr);
  ref->init_weights(11);
  {
    DeferAllocation defer;  // every rank computes only its own pieces of the parameters
    par = llama3::Transformer(args, at::TensorOptions());
  }
  dist::DataParallelOptions dpo;
  dist::DataParallel data_par(mesh["dp_shard_cp"], mesh["dp_replicate"], dpo,
                              [&](const std::string& name, at::Tensor out, const std::vector<int64_t>& begin) {
                                par->init_region(11, name, out, begin);
                              },
                              mesh.device());
  dist::TensorParallel tensor_par(mesh["tp"], tpo);
  ParallelizeContext ctx;
  ctx.data_parallel = &data_par;
  ctx.tensor_parallel = &tensor_par;
  ctx.ac_mode = ac;
  const ParallelizedModel model = parallelize_decoder(*par, ctx);

  std::vector<std::pair<std::string, at::Tensor>> ref_named;
  for (const auto& p : ref->named_parameters()) ref_named.emplace_back(p.key(), p.value());
  OptimizerOptions oo;
  oo.lr = 1e-3;
  Optimizer ref_opt(ref_named, oo), par_opt(data_par.named_parameters(), oo);

  // Every parameter holds 1/tp of the model's weights except the replicated norms.
  int64_t local = 0, norms = 0;
  for (const auto& p : data_par.parameters()) {
    local += p.local.numel();
    if (p.name.find("norm") != std::string::npos) norms += at::ones(p.placement.global_shape).numel();
  }
  const int64_t fsdp_degree = data_par.fsdp() ? mesh["dp_shard_cp"].size() : 1;
  const int64_t expected_local = (ref->num_params() - norms) / tp / fsdp_degree + norms / fsdp_degree;
  // The model's size and FLOPs are the global model's whatever the shards (the log line's MFU).
  TITAN_WORKER_CHECK(par->num_params() == ref->num_params() && par->flops_per_token(kSeqLen) == ref->flops_per_token(kSeqLen),
                     "the parallelized model counts %lld parameters, the model has %lld", (long long)par->num_params(),
                     (long long)ref->num_params());
  TITAN_WORKER_CHECK(local >= expected_local && local <= expected_local * 105 / 100,
                     "this rank holds %lld parameter elements, expected ~%lld", (long long)local,
                     (long long)expected_local);

  double worst_grad = 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    const at::Tensor global = seq[step];
    ref_opt.zero_grad();
    at::Tensor ref_loss;
    {
      Bf16Autocast scope(at::kCPU, autocast);
      ref_loss = nn::cross_entropy_sum(ref->forward(global.slice(1, 0, kSeqLen)).flatten(0, 1),
                                       global.slice(1, 1, kSeqLen + 1).flatten(0, 1)) / global_tokens;
    }
    ref_loss.backward();

    mesh.reset_bytes();
    par_opt.zero_grad();
    const at::Tensor mine = global.slice(0, dp_rank * kLocalBatch, (dp_rank + 1) * kLocalBatch);
    at::Tensor loss;
    {
      Bf16Autocast scope(at::kCPU, autocast);
      at::Tensor logits = par->forward(mine.slice(1, 0, kSeqLen));
      const int64_t V = logits.size(-1);
      TITAN_WORKER_CHECK(V == (tpo.loss_parallel ? kVocab / tp : kVocab), "logits of %lld entries", (long long)V);
      loss = model.loss_sum(logits.flatten(0, 1), mine.slice(1, 1, kSeqLen + 1).flatten(0, 1)) / global_tokens;
    }
    data_par.before_backward(true);
    loss.backward();
    data_par.after_backward(true);
    const dist::CommBytes bytes = mesh.bytes();
    at::Tensor total = loss.detach().clone();
    mesh["dp"].all_reduce(total).wait();
    TITAN_WORKER_CHECK(std::abs(total.item<double>() - ref_loss.item<double>()) <= loss_tol * ref_loss.item<double>(),
                       "step %lld loss %.8f vs single process %.8f", (long long)step, total.item<double>(),
                       ref_loss.item<double>());

    // Gradients through their placements, and the global norm.
    std::map<std::string, at::Tensor> ref_grads;
    for (auto& [n, p] : ref_named) ref_grads[n] = p.grad();
    for (const auto& p : data_par.parameters()) {
      const at::Tensor grad = dist::gather_full({p.name, p.local.grad(), p.placement}, mesh);
      const double err = test::relative_error(grad, ref_grads.at(p.name)),
                   tol = autocast ? grad_tol : step == 0 ? 1e-5 : 1e-4;
      worst_grad = std::max(worst_grad, err);
      TITAN_WORKER_CHECK(err <= tol, "step %lld gradient of %s differs by %.3g", (long long)step, p.name.c_str(), err);
    }
    std::vector<at::Tensor> ref_params;
    for (auto& [n, p] : ref_named) ref_params.push_back(p);
    const double ref_norm = clip_grad_norm(ref_params, 0.0), norm = dist::global_grad_norm(data_par.parameters(), mesh);
    TITAN_WORKER_CHECK(std::abs(norm - ref_norm) <= (autocast ? grad_tol : 1e-5) * ref_norm,
                       "step %lld gradient norm %.8f vs %.8f",
                       (long long)step, norm, ref_norm);

    // Bytes over tp (docs/parallelism.md). A = one activation (B, S, D) in fp32; L blocks. Sequence
    // parallel: per block 2 all-gathers and 2 reduce-scatters in forward and their duals in backward,
    // plus the embedding's reduce-scatter and the final norm's all-gather (and their duals): 4L + 2
    // of each. Without: 4L + 2 all-reduces. Loss parallel: 3 floats per token all-reduced; else the
    // logits all-gathered. Sequence parallel also sums the norms' gradients (their local pieces).
    if (ac == "none" && !autocast) {
      const int64_t A = kLocalBatch * kSeqLen * args.dim * 4, n_collectives = 4 * kLayers + 2;
      const int64_t tokens = kLocalBatch * kSeqLen;
      int64_t norm_grads = 0;
      for (const auto& p : data_par.parameters())
        if (p.name.find("norm") != std::string::npos) norm_grads += p.local.numel() * 4;
      auto got = [&](const char* op) {
        auto it = bytes.at("tp").find(op);
        return it == bytes.at("tp").end() ? int64_t{0} : it->second;
      };
      const int64_t want_gather = (tpo.sequence_parallel ? n_collectives * A : 0) +
                                  (tpo.loss_parallel ? 0 : tokens * kVocab * 4);
      const int64_t want_scatter = tpo.sequence_parallel ? n_collectives * A : 0;
      const int64_t want_reduce = (tpo.sequence_parallel ? norm_grads : n_collectives * A) +
                                  (tpo.loss_parallel ? 3 * tokens * 4 : 0);
      TITAN_WORKER_CHECK(got("all_gather") == want_gather && got("reduce_scatter") == want_scatter &&
                             got("all_reduce") == want_reduce,
                         "tp moved all-gather %lld, reduce-scatter %lld, all-reduce %lld bytes; expected %lld, %lld, %lld",
                         (long long)got("all_gather"), (long long)got("reduce_scatter"), (long long)got("all_reduce"),
                         (long long)want_gather, (long long)want_scatter, (long long)want_reduce);
      if (tpo.async) {  // decomposed: several collectives per region, the same bytes
        const int64_t calls = mesh.calls().at("tp").at("all_gather");
        TITAN_WORKER_CHECK(calls > n_collectives, "async TP issued %lld all-gathers, expected more than %lld",
                           (long long)calls, (long long)n_collectives);
      }
    }
    ref_opt.step();
    par_opt.step();
  }
  std::map<std::string, at::Tensor> final_params;
  for (const auto& p : data_par.parameters()) final_params[p.name] = dist::gather_full(p, mesh);
  double worst_param = 0;
  for (auto& [name, p] : ref_named) {
    const double err = (final_params.at(name) - p.detach()).abs().max().item<double>();
    worst_param = std::max(worst_param, err);
    TITAN_WORKER_CHECK(err <= (autocast ? 1.0 : 0.01) * oo.lr * kSteps, "parameter %s after %lld steps differs by %.3g", name.c_str(),
                       (long long)kSteps, err);
  }
  std::printf("rank %d: %s matches the single process (worst gradient %.2e, worst final parameter %.2e)\n", rank,
              dims.describe().c_str(), worst_grad, worst_param);
  return 0;
}

void run_tp(int world, int tp, std::map<std::string, std::string> env) {
  auto server = dist::make_tcp_store("127.0.0.1", 0, true, 60s);
  env["TITAN_TEST_PORT"] = std::to_string(dist::store_port(server));
  env["TITAN_TEST_WORLD"] = std::to_string(world);
  env["TITAN_TEST_TP"] = std::to_string(tp);
  env["OMP_NUM_THREADS"] = "1";
  auto results = test::run_workers("tensor_parallel", world, env, 300s);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find("matches the single process"), std::string::npos) << results[r].output;
  }
}

TEST(TensorParallel, Tp2) { run_tp(2, 2, {}); }
TEST(TensorParallel, Tp4) { run_tp(4, 4, {}); }
TEST(TensorParallel, Tp2WithoutSequenceParallel) { run_tp(2, 2, {{"TITAN_TEST_SP", "0"}}); }
TEST(TensorParallel, Tp2WithoutLossParallel) { run_tp(2, 2, {{"TITAN_TEST_LOSS_PARALLEL", "0"}}); }
TEST(TensorParallel, AsyncTp2) { run_tp(2, 2, {{"TITAN_TEST_ASYNC", "1"}}); }
TEST(TensorParallel, Tp2xFsdp2) { run_tp(4, 2, {{"TITAN_TEST_SHARD", "2"}}); }
TEST(TensorParallel, Tp2xDdp2) { run_tp(4, 2, {{"TITAN_TEST_REPLICATE", "2"}}); }
TEST(TensorParallel, Tp2xHsdp2x2) { run_tp(8, 2, {{"TITAN_TEST_REPLICATE", "2"}, {"TITAN_TEST_SHARD", "2"}}); }
TEST(TensorParallel, AsyncTp2xFsdp2WithActivationCheckpointing) {
  run_tp(4, 2, {{"TITAN_TEST_SHARD", "2"}, {"TITAN_TEST_ASYNC", "1"}, {"TITAN_TEST_AC", "full"}});
}
TEST(TensorParallel, Tp2WithTiedEmbeddings) { run_tp(2, 2, {{"TITAN_TEST_TIED", "1"}}); }
TEST(TensorParallel, Tp2xFsdp2WithTiedEmbeddingsWithoutLossParallel) {
  run_tp(4, 2, {{"TITAN_TEST_TIED", "1"}, {"TITAN_TEST_SHARD", "2"}, {"TITAN_TEST_LOSS_PARALLEL", "0"}});
}
// Without FSDP on CUDA the forward runs under bf16 autocast: weights fp32, activations and their
// gradients bf16 (async TP's written-out backward must cast).
TEST(TensorParallel, AsyncTp2UnderBf16Autocast) { run_tp(2, 2, {{"TITAN_TEST_ASYNC", "1"}, {"TITAN_TEST_AUTOCAST", "1"}}); }
TEST(TensorParallel, Tp2UnderBf16Autocast) { run_tp(2, 2, {{"TITAN_TEST_AUTOCAST", "1"}}); }
TEST(TensorParallel, Tp2WithPerOperatorActivationCheckpointing) { run_tp(2, 2, {{"TITAN_TEST_AC", "op"}}); }

// Loss parallel never holds the whole logits: with a large vocabulary, the peak CPU memory of the
// loss (forward and backward, logits included) under TP 2 is about half of gathering the logits
// first (measured by the counting allocator).
TITAN_TEST_WORKER_FN(loss_parallel_memory) {
  mem::install_cpu_tracking();
  const int rank = env_int("TITAN_TEST_RANK");
  at::set_num_threads(1);
  auto store = dist::make_tcp_store("127.0.0.1", static_cast<uint16_t>(env_int("TITAN_TEST_PORT")), false, 60s);
  dist::ParallelDims dims(1, 1, 1, 2, 1, 2);
  dist::Mesh mesh(dims, rank, store, dist::BackendKind::Gloo, 60s);
  dist::Group& g = mesh["tp"];
  constexpr int64_t N = 512, V = 32768, Vn = V / 2;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  const at::Tensor all = at::randn({N, V}, gen);
  const at::Tensor labels = at::randint(V, {N}, gen, at::kLong);
  auto peak_of = [&](bool parallel) {
    at::Tensor mine = all.slice(1, rank * Vn, (rank + 1) * Vn).clone().requires_grad_(true);
    mem::PeakScope scope;
    at::Tensor loss = parallel ? dist::vocab_parallel_cross_entropy_sum(mine, labels, g, rank * Vn)
                               : nn::cross_entropy_sum(dist::tp_gather_slices(mine, g, 1), labels);
    loss.backward();
    const double value = loss.item<double>();
    return std::make_pair(scope.peak_above_start(), value);
  };
  const auto [gathered_peak, gathered_loss] = peak_of(false);
  const auto [parallel_peak, parallel_loss] = peak_of(true);
  TITAN_WORKER_CHECK(std::abs(parallel_loss - gathered_loss) <= 1e-5 * gathered_loss, "loss %.6f vs %.6f",
                     parallel_loss, gathered_loss);
  const double ratio = static_cast<double>(parallel_peak) / static_cast<double>(gathered_peak);
  std::printf("rank %d: loss peak with the logits gathered %.1f MiB, loss parallel %.1f MiB (x%.2f)\n", rank,
              gathered_peak / 1048576.0, parallel_peak / 1048576.0, ratio);
  TITAN_WORKER_CHECK(ratio < 0.6, "loss parallel peaked at %.2f of the gathered loss's peak", ratio);
  return 0;
}

TEST(TensorParallel, LossParallelHalvesTheLossPeakMemoryAtTp2) {
  auto server = dist::make_tcp_store("127.0.0.1", 0, true, 60s);
  auto results = test::run_workers("loss_parallel_memory", 2,
                                   {{"TITAN_TEST_PORT", std::to_string(dist::store_port(server))}, {"OMP_NUM_THREADS", "1"}},
                                   300s);
  for (size_t r = 0; r < results.size(); ++r) {
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ":\n" << results[r].output;
    EXPECT_NE(results[r].output.find("loss parallel"), std::string::npos) << results[r].output;
    std::printf("%s", results[r].output.c_str());
  }
}

// Degrees that do not divide the model are clear errors naming what to change.
TEST(TensorParallel, DegreesThatDoNotDivideTheModelAreClearErrors) {
  auto server = dist::make_tcp_store("127.0.0.1", 0, true, 60s);
  dist::ParallelDims dims(1, 1, 1, 1, 1, 1);
  dist::Mesh mesh(dims, 0, server, dist::BackendKind::Gloo, 60s);
  // A group of 3 "ranks" is never used for communication here: the plan checks before sharding.
  auto error_of = [&](llama3::ModelArgs a, int tp) -> std::string {
    llama3::Transformer m(nullptr);
    {
      DeferAllocation defer;
      m = llama3::Transformer(a, at::TensorOptions());
    }
    std::vector<int> ranks(static_cast<size_t>(tp));
    for (int i = 0; i < tp; ++i) ranks[static_cast<size_t>(i)] = i;
    dist::CommBytes bytes, calls;
    dist::Group group("tp", ranks, 0, c10::intrusive_ptr<c10d::Backend>(), &bytes, &calls);
    dist::TensorParallel tensor_par(group, {});
    dist::DataParallel data_par(mesh["dp_shard_cp"], mesh["dp_replicate"], {}, [](auto&&...) {}, mesh.device());
    ParallelizeContext ctx;
    ctx.data_parallel = &data_par;
    ctx.tensor_parallel = &tensor_par;
    try {
      parallelize_decoder(*m, ctx);
    } catch (const UserError& e) {
      return e.what();
    }
    return "";
  };
  llama3::ModelArgs a = test::tiny_llama(1, 128, 64);  // 4 heads, 2 KV heads, hidden 192
  std::string e = error_of(a, 4);
  EXPECT_NE(e.find("n_kv_heads 2"), std::string::npos) << e;
  EXPECT_NE(e.find("tensor_parallel_degree 4"), std::string::npos) << e;
  a.n_kv_heads = 4;
  e = error_of(a, 3);
  EXPECT_NE(e.find("n_heads 4"), std::string::npos) << e;
  a = test::tiny_llama(1, 130, 64);
  a.n_kv_heads = 4;
  e = error_of(a, 4);
  EXPECT_NE(e.find("vocabulary size 130"), std::string::npos) << e;
  a = test::tiny_llama(1, 128, 64);
  a.multiple_of = 3;
  a.ffn_dim_multiplier.reset();  // hidden 171: odd
  e = error_of(a, 2);
  EXPECT_NE(e.find("feed-forward hidden size 171"), std::string::npos) << e;
  try {
    dist::check_sequence_length(30, 4, true);
    ADD_FAILURE() << "a sequence of 30 over 4 ranks was accepted";
  } catch (const UserError& err) {
    EXPECT_NE(std::string(err.what()).find("training.seq_len 30"), std::string::npos) << err.what();
  }
  EXPECT_NO_THROW(dist::check_sequence_length(30, 4, false));
}

}  // namespace
}  // namespace titan
