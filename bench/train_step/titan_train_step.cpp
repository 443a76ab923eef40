// CPU training-step benchmark, titan side: the debug-size Llama 3 model, a fixed random batch,
// forward + cross-entropy + backward + clip + fused AdamW, timed per step after warm-up.
// Prints one JSON line: {"impl": "titan", "median_ms": ..., "steps": [...]}.
// usage: titan_bench_train_step [batch] [seq_len] [steps] [warmup]
#include "titan/components/optimizer/optimizer.h"
#include "titan/models/llama3/model.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  const int64_t batch = argc > 1 ? std::atoll(argv[1]) : 4;
  const int64_t seq_len = argc > 2 ? std::atoll(argv[2]) : 256;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 10;
  const int warmup = argc > 4 ? std::atoi(argv[4]) : 3;

  titan::llama3::ModelArgs args = titan::llama3::flavor("debugmodel");
  titan::llama3::Transformer model(args, at::TensorOptions().dtype(at::kFloat));
  model->init_weights(0);
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& p : model->named_parameters()) named.emplace_back(p.key(), p.value());
  titan::Optimizer opt(named, titan::OptimizerOptions{});
  at::Tensor tokens = at::randint(args.vocab_size, {batch, seq_len + 1}, at::kLong);
  at::Tensor inputs = tokens.slice(1, 0, seq_len), labels = tokens.slice(1, 1, seq_len + 1);

  std::vector<double> ms;
  for (int i = 0; i < warmup + steps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    at::Tensor logits = model->forward(inputs);
    at::Tensor loss = at::cross_entropy_loss(logits.flatten(0, 1), labels.flatten(0, 1));
    loss.backward();
    titan::clip_grad_norm(model->parameters(), 1.0);
    opt.step();
    (void)loss.item<float>();
    auto t1 = std::chrono::steady_clock::now();
    if (i >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  std::printf("{\"impl\": \"titan\", \"threads\": %d, \"median_ms\": %.3f, \"steps\": [", at::get_num_threads(),
              sorted[sorted.size() / 2]);
  for (size_t i = 0; i < ms.size(); ++i) std::printf("%s%.3f", i ? ", " : "", ms[i]);
  std::printf("]}\n");
  return 0;
}
