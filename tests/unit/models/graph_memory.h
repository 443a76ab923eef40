// Measured memory of a differentiable computation on the CPU, through the counting allocator
// (titan/common/memory_tracker.h):
//   saved: bytes the autograd graph keeps alive from forward to backward, i.e. bytes alive after a
//          forward pass that records the graph minus after the same pass without it (the output is
//          alive in both). The activations are built inside the measurement (a copy of each given
//          one), so a function that saves its input is charged for it, as in a model where the
//          input is the previous layer's output.
//   peak:  the most bytes alive at once, above what was alive before, over forward and backward
//          (backward from a gradient of ones).
#pragma once

#include "titan/common/memory_tracker.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <functional>
#include <vector>

namespace titan::test {

struct GraphMemory {
  int64_t saved = 0, peak = 0;
};

using GraphFn = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// activations: tensors requiring grad are copied inside the measurement; others (labels, tables) are
// passed as they are. Parameters belong in f's closure and are not charged; their gradients are
// dropped before the peak run so that every measurement allocates them afresh.
inline GraphMemory measure_graph(const GraphFn& f, const std::vector<at::Tensor>& activations,
                                 const std::vector<at::Tensor>& params = {}) {
  mem::install_cpu_tracking();
  auto run = [&] {
    std::vector<at::Tensor> in;
    for (const auto& a : activations) in.push_back(a.requires_grad() ? a.mul(1) : a);
    return f(in);  // the copies are released with `in` unless the graph keeps them
  };
  auto alive_after_forward = [&](bool record) {
    at::AutoGradMode mode(record);
    const int64_t before = mem::cpu_allocated_bytes();
    at::Tensor out = run();
    return mem::cpu_allocated_bytes() - before;
  };
  GraphMemory m;
  const int64_t with_graph = alive_after_forward(true);
  m.saved = with_graph - alive_after_forward(false);
  for (const auto& a : activations) a.mutable_grad().reset();
  for (const auto& p : params) p.mutable_grad().reset();
  {
    mem::PeakScope scope;
    {
      at::Tensor out = run();
      out.backward(at::ones_like(out));
    }
    m.peak = scope.peak_above_start();
  }
  for (const auto& a : activations) a.mutable_grad().reset();
  for (const auto& p : params) p.mutable_grad().reset();
  return m;
}

}  // namespace titan::test
