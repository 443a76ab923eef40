// Checkpoint metadata at scale, simulated on the meta device: the slice indexes every rank of a save
// writes, what rank 0 gathers and reads to write index.json, and the index bytes one rank reads at
// resume, for a flavor's real parameter shapes under FSDP x TP x PP (Llama's tensor-parallel plan:
// attention wq/wk/wv and feed-forward w1/w3 column-wise, wo/w2 row-wise, the embedding and output by
// vocabulary rows, norms replicated over tp). Parameters, exp_avg and exp_avg_sq are placed alike; the
// optimizer's step counts are written by the first piece's writer. The previous format (every slice in
// index.json, every rank's records through the store) is measured on the same slices for comparison.
//
//   build/titan_checkpoint_metadata_bench --flavor 405B --dp-shard 16 --tp 8 --pp 1
//   build/titan_checkpoint_metadata_bench --flavor 405B --dp-shard 16 --tp 8 --pp 16   (2,048 ranks)
#include "titan/components/checkpoint/checkpoint.h"
#include "titan/models/registry.h"

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <regex>
#include <set>
#include <string>

using namespace titan;

namespace {

struct Param {
  std::string name;
  std::vector<int64_t> shape;
  int64_t tp_dim = -1;  // -1: replicated over tp
  int layer = -1;       // -1: embedding (stage 0) or norm/output (last stage)
};

std::vector<Param> params_of(const std::string& flavor) {
  LanguageModel m = model_spec("llama3").build(flavor, at::TensorOptions().device(at::kMeta).dtype(at::kFloat), 2048);
  std::vector<Param> out;
  static const std::regex layer_re(R"(^layers\.(\d+)\.)");
  for (const auto& p : m->named_parameters()) {
    Param q{p.key(), p.value().sizes().vec()};
    const std::string& n = q.name;
    auto has = [&](const char* s) { return n.find(s) != std::string::npos; };
    if (has("wq.") || has("wk.") || has("wv.") || has("w1.") || has("w3.") || has("output.") || has("tok_embeddings."))
      q.tp_dim = 0;
    else if (has("wo.") || has("w2."))
      q.tp_dim = 1;
    std::smatch m2;
    if (std::regex_search(n, m2, layer_re)) q.layer = std::stoi(m2[1]);
    out.push_back(q);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string flavor = "405B";
  int dp_shard = 16, tp = 8, pp = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--flavor") flavor = v;
    else if (k == "--dp-shard") dp_shard = std::stoi(v);
    else if (k == "--tp") tp = std::stoi(v);
    else if (k == "--pp") pp = std::stoi(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  const std::vector<Param> params = params_of(flavor);
  int layers = 0;
  for (const auto& p : params) layers = std::max(layers, p.layer + 1);
  const int world = dp_shard * tp * pp;
  // Rank r: pp outermost, then dp_shard, tp innermost (ParallelDims' order).
  auto slices_of = [&](int r) {
    const int t = r % tp, d = (r / tp) % dp_shard, s = r / (tp * dp_shard);
    std::vector<dist::PlacedTensor> tensors;
    for (const auto& p : params) {
      const int stage = p.layer >= 0 ? p.layer * pp / layers : (p.name.rfind("tok_embeddings", 0) == 0 ? 0 : pp - 1);
      if (stage != s) continue;
      dist::Placement pl;
      pl.global_shape = p.shape;
      std::vector<int64_t> local = p.shape;
      if (p.tp_dim >= 0) {
        pl.shards.push_back(dist::chunk("tp", p.tp_dim, p.shape[static_cast<size_t>(p.tp_dim)], t, tp));
        local[static_cast<size_t>(p.tp_dim)] = pl.shards.back().local_size;
      } else {
        pl.replicated.push_back("tp");
      }
      pl.shards.push_back(dist::chunk("dp_shard_cp", 0, local[0], d, dp_shard));
      local[0] = pl.shards.back().local_size;
      const at::Tensor meta = at::empty(local, at::TensorOptions().device(at::kMeta));
      for (const char* kind : {"model.", "optimizer."}) {
        const std::string base = std::string(kind) + p.name;
        if (std::string(kind) == "model.") {
          tensors.push_back({base, meta, pl});
        } else {
          tensors.push_back({base + ".exp_avg", meta, pl});
          tensors.push_back({base + ".exp_avg_sq", meta, pl});
        }
      }
      bool first = true;
      for (const auto& sh : pl.shards) first = first && sh.offset == 0;
      const at::Tensor step = at::empty({}, at::TensorOptions().device(at::kMeta));
      tensors.push_back({"optimizer." + p.name + ".step", step, dist::whole(step, {}, first && (p.tp_dim >= 0 || t == 0))});
    }
    checkpoint::assign_writers(tensors, [&](const std::string&) { return std::pair<int, int>(t, tp); });
    checkpoint::Snapshot snap;
    for (const auto& x : tensors) {
      if (!x.placement.primary || x.placement.real_numel() == 0) continue;
      snap.slices.push_back({x.name, at::empty(x.placement.global_length(), at::TensorOptions().device(at::kMeta)),
                             x.placement.global_shape, x.placement.global_begin()});
    }
    return snap.slices;
  };

  const auto t0 = std::chrono::steady_clock::now();
  const checkpoint::MetadataSimulation sim = checkpoint::simulate_metadata(world, slices_of);
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const nlohmann::json index = nlohmann::json::parse(sim.index);

  // One rank's reads at resume under the same layout: index.json, then the slice indexes of the files
  // holding pieces of its tensors (rank 0 of the last stage: the largest share of files, with the output).
  const int reader = (pp - 1) * tp * dp_shard;
  int64_t read_bytes = static_cast<int64_t>(sim.index.size());
  const auto t1 = std::chrono::steady_clock::now();
  std::set<int64_t> needed;
  for (const auto& s : slices_of(reader)) {
    for (const auto& range : index.at("tensors").at(s.name).at("shards"))
      for (int64_t i = range[0].get<int64_t>(); i < range[1].get<int64_t>(); ++i) needed.insert(i);
  }
  const double plan_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  const auto& stems = index.at("shards");
  for (int64_t i : needed) {
    const int rank = std::stoi(stems[static_cast<size_t>(i)].get<std::string>().substr(5));
    read_bytes += sim.slice_index_bytes[static_cast<size_t>(rank)];
  }

  // The previous format: every rank sent its slice records (name, dtype, shapes, offsets, CRC-32 as JSON)
  // through the store, and index.json listed every slice; every rank read all of it.
  int64_t old_gathered = 0, old_slices = 0, slice_index_total = 0;
  for (int r = 0; r < world; ++r) slice_index_total += sim.slice_index_bytes[static_cast<size_t>(r)];
  for (int r = 0; r < world; ++r) {
    for (const auto& s : slices_of(r)) {
      nlohmann::json rec = {{"name", s.name}, {"dtype", "F32"}, {"global_shape", s.global_shape}, {"begin", s.begin},
                            {"length", s.data.sizes().vec()}, {"crc32", 4294967295u}};
      old_gathered += static_cast<int64_t>(rec.dump().size()) + 1;
      nlohmann::json slice = {{"file", "rank-00000.safetensors"}, {"begin", s.begin}, {"length", s.data.sizes().vec()},
                              {"crc32", 4294967295u}};
      old_slices += static_cast<int64_t>(slice.dump(1).size()) + 4;
    }
  }
  auto mb = [](int64_t b) { return b / 1e6; };
  std::printf("flavor %s, FSDP %d x TP %d x PP %d = %d ranks, %zu parameters\n", flavor.c_str(), dp_shard, tp, pp, world,
              params.size());
  std::printf("  slice index per rank: %.3f MB (largest), %.1f MB all ranks\n",
              mb(*std::max_element(sim.slice_index_bytes.begin(), sim.slice_index_bytes.end())), mb(slice_index_total));
  std::printf("  rank 0: gathered %.3f MB (%d x 256-byte records), read back %.3f MB of slice indexes, "
              "index.json %.3f MB, built in %.2f s\n",
              mb(sim.cost.gathered_bytes), world, mb(sim.cost.slice_index_bytes_read), mb(sim.cost.index_bytes),
              sim.rank0_seconds);
  std::printf("  resume, rank %d: reads %.3f MB of index (index.json + %zu slice indexes), plans in %.3f s\n", reader,
              mb(read_bytes), needed.size(), plan_s);
  std::printf("  previous format: %.1f MB through the store to rank 0, index.json ~%.1f MB read by every rank\n",
              mb(old_gathered), mb(old_slices));
  std::printf("  (simulation total %.1f s)\n", total_s);
  return 0;
}
