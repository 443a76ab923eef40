// FSDP training step: one collective per unit (flat buffers, titan's FSDP as the trainer applies it)
// against one collective per parameter (every parameter-holding module its own unit), same model,
// batch and processes, in one run. Started by bench/fsdp/run.sh as N processes (env RANK, WORLD_SIZE,
// MASTER_PORT); rank 0 prints one line per mode and round: median step seconds, collectives and
// bytes per step on the shard group.
#include "titan/components/optimizer/optimizer.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/mesh.h"
#include "titan/models/llama3/model.h"
#include "titan/models/common/decoder_parallelize.h"
#include "titan/models/registry.h"
#include "titan/common/tensor_storage.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace titan;
using Clock = std::chrono::steady_clock;

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

// Every module with parameters of its own a unit, in forward order (one all-gather and one
// reduce-scatter per parameter), then the root (the embedding).
void shard_per_parameter(llama3::TransformerImpl& m, dist::FSDP& fsdp, const dist::InitRows& init) {
  for (const auto& [p, b] : m.blocks()) {
    std::vector<std::pair<std::string, nn::HookedModule*>> mods = {
        {"attention_norm.", b->attention_norm.get()}, {"attention.wq.", b->attention->wq.get()},
        {"attention.wk.", b->attention->wk.get()},     {"attention.wv.", b->attention->wv.get()},
        {"attention.wo.", b->attention->wo.get()},     {"ffn_norm.", b->ffn_norm.get()},
        {"feed_forward.w1.", b->feed_forward->w1.get()}, {"feed_forward.w3.", b->feed_forward->w3.get()},
        {"feed_forward.w2.", b->feed_forward->w2.get()}};
    for (auto& [name, mod] : mods) fsdp.fully_shard(*mod, p + name, init);
  }
  fsdp.fully_shard(*m.norm, "norm.", init);
  if (m.output) fsdp.fully_shard(*m.output, "output.", init);
  fsdp.fully_shard(m, "", init);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string flavor = argc > 1 ? argv[1] : "debugmodel";
  const int64_t batch = argc > 2 ? std::atoll(argv[2]) : 2, seq = argc > 3 ? std::atoll(argv[3]) : 256;
  const int steps = argc > 4 ? std::atoi(argv[4]) : 8, rounds = argc > 5 ? std::atoi(argv[5]) : 3;
  const int rank = env_int("RANK", 0), world = env_int("WORLD_SIZE", 2);
  auto store = dist::make_tcp_store("127.0.0.1", static_cast<uint16_t>(env_int("MASTER_PORT", 29511)), rank == 0,
                                    std::chrono::seconds(120));
  dist::ParallelDims dims(1, world, 1, 1, 1, world);
  dist::Mesh mesh(dims, rank, store, dist::BackendKind::Gloo, std::chrono::seconds(120));
  const ModelSpec& spec = model_spec("llama3");
  at::Tensor tokens = at::randint(2000, {steps + 2, batch, seq + 1}, at::kLong);
  if (rank == 0)
    std::printf("# FSDP %d on CPU, llama3 %s, batch %lld x seq %lld per rank, %d timed steps per round\n", world,
                flavor.c_str(), (long long)batch, (long long)seq, steps);
  for (int round = 0; round < rounds; ++round) {
    for (const std::string mode : {"per-unit", "per-parameter"}) {
      LanguageModel model;
      {
        DeferAllocation defer;
        model = spec.build(flavor, at::TensorOptions(), seq);
      }
      auto* m = dynamic_cast<llama3::TransformerImpl*>(model.get());
      dist::DataParallelOptions dpo;
      dpo.shard_always = true;
      dist::DataParallel dp(mesh["dp_shard_cp"], mesh["dp_replicate"], dpo,
                            [&](const std::string& name, at::Tensor out, const std::vector<int64_t>& begin) {
                              model->init_region(0, name, out, begin);
                            },
                            mesh.device());
      dist::FSDP& fsdp = *dp.fsdp();
      dist::InitRows init = [&](const std::string& name, at::Tensor rows, int64_t first) {
        model->init_rows(0, name, rows, first);
      };
      if (mode == "per-unit") {
        ParallelizeContext ctx;
        ctx.data_parallel = &dp;
        spec.parallelize(*model, ctx);
      } else {
        shard_per_parameter(*m, fsdp, init);
      }
      Optimizer opt(fsdp.sharded_parameters(), OptimizerOptions{});
      std::vector<double> times;
      int64_t calls = 0, bytes = 0;
      for (int s = 0; s < steps + 2; ++s) {
        mesh.reset_bytes();
        const auto t0 = Clock::now();
        opt.zero_grad();
        at::Tensor x = tokens[s];
        at::Tensor logits = model->forward(x.slice(1, 0, seq));
        at::Tensor loss = at::cross_entropy_loss(logits.flatten(0, 1), x.slice(1, 1, seq + 1).flatten(0, 1));
        loss.backward();
        fsdp.finish_backward();
        opt.step();
        if (s >= 2) times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
        calls = 0;
        bytes = 0;
        for (const auto& [op, n] : mesh.calls().at("dp_shard_cp")) calls += n;
        for (const auto& [op, n] : mesh.bytes().at("dp_shard_cp")) bytes += n;
      }
      std::sort(times.begin(), times.end());
      if (rank == 0)
        std::printf("%s round %d: median step %.4f s, %lld collectives and %.1f MB per step, %zu units\n", mode.c_str(),
                    round + 1, times[times.size() / 2], (long long)calls, bytes / 1e6, fsdp.num_units());
      std::fflush(stdout);
    }
  }
  return 0;
}
