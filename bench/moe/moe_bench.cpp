// One MoE layer's training step (forward, backward): titan's layer with grouped matmuls and with one
// matmul per expert. Prints one JSON line per variant: the median step time. On the CPU in fp32; with
// DEVICE cuda on the GPU in bf16 (parameters and activations), timed with a device synchronization
// around each step.
// usage: titan_moe_bench TOKENS DIM HIDDEN EXPERTS TOP_K STEPS [cpu|cuda]
// env TRACE=DIR: the grouped variant's fourth step recorded by the profiler as a Chrome trace,
// DIR/iteration_4/rank0_trace.json (bench/gpu/kernels.py sums its kernels).
#include "titan/components/metrics/profiler.h"
#include "titan/nn/moe.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s TOKENS DIM HIDDEN EXPERTS TOP_K STEPS [cpu|cuda]\n", argv[0]);
    return 2;
  }
  const int64_t T = std::atoll(argv[1]), D = std::atoll(argv[2]), F = std::atoll(argv[3]), E = std::atoll(argv[4]),
                K = std::atoll(argv[5]), steps = std::atoll(argv[6]);
  const bool cuda = argc > 7 && std::string(argv[7]) == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "titan_moe_bench: no CUDA device visible\n");
    return 2;
  }
  const at::TensorOptions opts =
      cuda ? at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA) : at::TensorOptions().dtype(at::kFloat);
  auto sync = [&] {
    if (cuda) torch::cuda::synchronize();
  };
  for (const bool grouped : {true, false}) {
    titan::nn::MoEOptions o;
    o.dim = D;
    o.hidden_dim = F;
    o.num_experts = E;
    o.top_k = K;
    o.route_norm = true;
    o.grouped_mm = grouped;
    titan::nn::MoE moe(o, opts);
    at::manual_seed(0);
    {
      at::NoGradGuard no_grad;
      for (auto& p : moe->parameters()) p.normal_(0, 0.02);
    }
    const at::Tensor x = at::randn({1, T, D}, opts).requires_grad_(true);
    const at::Tensor g = at::randn({1, T, D}, opts);
    std::unique_ptr<titan::metrics::Profiler> profiler;
    const char* trace = std::getenv("TRACE");
    if (grouped && trace != nullptr && *trace != '\0') {
      titan::metrics::ProfilerOptions po;
      po.traces = true;
      po.traces_dir = trace;
      po.freq = 4;
      po.warmup = 1;
      po.active = 1;
      po.device = opts.device();
      profiler = std::make_unique<titan::metrics::Profiler>(po);
    }
    std::vector<double> ms;
    for (int64_t s = 0; s < steps + 3; ++s) {
      if (profiler && s < 4) profiler->step_begin(s + 1);
      sync();
      const auto t0 = std::chrono::steady_clock::now();
      (moe->forward(x) * g).sum().backward();
      sync();
      const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (s >= 3) ms.push_back(dt);  // 3 warm-up steps
      if (profiler && s < 4) profiler->step_end(s + 1);
      for (auto& p : moe->parameters()) p.mutable_grad() = at::Tensor();
      x.mutable_grad() = at::Tensor();
    }
    std::sort(ms.begin(), ms.end());
    std::printf("{\"impl\": \"titan_%s\", \"threads\": %d, \"median_ms\": %.3f}\n", grouped ? "grouped" : "loop",
                at::get_num_threads(), ms[ms.size() / 2]);
    std::fflush(stdout);
  }
  return 0;
}
