// Checkpoint throughput and how long a save blocks the training loop.
//
// The state of a Llama 3 flavor (default 1B: 1.24e9 parameters, fp32) is saved with titan's format
// into --dir, synchronously (written from the live tensors) and with async_mode (the loop is blocked
// only by the copy off the live tensors), and loaded back as one process would. Prints one JSON line per repetition; run.sh
// compares with the disk's own write speed (dd) on the same file system.
//
//   build/titan_checkpoint_bench --dir /path/on/disk [--flavor 1B] [--reps 3] [--optimizer]
#include "titan/components/checkpoint/checkpointer.h"
#include "titan/models/registry.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

int main(int argc, char** argv) {
  std::string dir, flavor = "1B";
  int reps = 3;
  bool optimizer = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--dir" && i + 1 < argc) dir = argv[++i];
    else if (a == "--flavor" && i + 1 < argc) flavor = argv[++i];
    else if (a == "--reps" && i + 1 < argc) reps = std::stoi(argv[++i]);
    else if (a == "--optimizer") optimizer = true;
    else { std::fprintf(stderr, "usage: %s --dir DIR [--flavor 1B] [--reps 3] [--optimizer]\n", argv[0]); return 2; }
  }
  if (dir.empty()) { std::fprintf(stderr, "--dir is required\n"); return 2; }
  // The flavor's parameter shapes, filled with values (initialization itself is not measured).
  auto model = titan::model_spec("llama3").build(flavor, at::TensorOptions(), 2048);
  std::vector<titan::dist::PlacedTensor> tensors;
  int64_t bytes = 0;
  for (const auto& p : model->named_parameters()) {
    p.value().detach().normal_();
    tensors.push_back({"model." + p.key(), p.value(), titan::dist::whole(p.value())});
    bytes += p.value().numel() * 4;
    if (!optimizer) continue;
    for (const char* s : {".exp_avg", ".exp_avg_sq"}) {
      at::Tensor t = at::randn_like(p.value());
      tensors.push_back({"optimizer." + p.key() + s, t, titan::dist::whole(t)});
      bytes += t.numel() * 4;
    }
  }
  const nlohmann::json info = {{"step", 1}, {"model", {{"name", "llama3"}, {"flavor", flavor}}}, {"contents", {"model"}}};
  for (int rep = 0; rep < reps; ++rep) {
    for (const std::string mode : {"disabled", "async", "async_with_pinned_mem"}) {
      std::filesystem::remove_all(dir + "/bench_ckpt");
      titan::config::Checkpoint cfg;
      cfg.enable = true;
      cfg.async_mode = mode;
      cfg.keep_latest_k = 0;
      titan::checkpoint::Checkpointer ck(cfg, dir + "/bench_ckpt", titan::checkpoint::single_process_coordinator(),
                                         [](const std::string&) {});
      // Two saves, so that async_with_pinned_mem reuses its buffers in the second (the one timed).
      double blocked = 0, total = 0;
      for (int step = 1; step <= 2; ++step) {
        const auto t0 = Clock::now();
        titan::checkpoint::SnapshotOptions so;  // as the trainer does
        so.copy = mode != "disabled";
        so.reuse = ck.reusable_snapshot();
        auto snap = titan::checkpoint::take_snapshot(tensors, so);
        snap.info = info;
        ck.save(step, std::move(snap));
        blocked = since(t0);
        ck.wait();
        total = since(t0);
      }
      std::printf("{\"mode\": \"%s\", \"gb\": %.3f, \"blocked_s\": %.3f, \"save_s\": %.3f, \"save_gbps\": %.3f}\n",
                  mode.c_str(), bytes / 1e9, blocked, total, bytes / 1e9 / total);
      std::fflush(stdout);
    }
    // Load as one process would: every tensor's block, checked against its CRC-32.
    const auto t0 = Clock::now();
    titan::checkpoint::Reader reader(dir + "/bench_ckpt/step-2");
    titan::checkpoint::check(reader, tensors, false);
    titan::checkpoint::load_into(reader, tensors, false);
    const double load = since(t0);
    std::printf("{\"mode\": \"load\", \"gb\": %.3f, \"load_s\": %.3f, \"load_gbps\": %.3f}\n", bytes / 1e9, load,
                bytes / 1e9 / load);
    std::fflush(stdout);
  }
  std::filesystem::remove_all(dir + "/bench_ckpt");
  return 0;
}
