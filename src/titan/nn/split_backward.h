// A backward split in two (zero-bubble pipeline schedules, PyTorch's stage_backward_input and
// stage_backward_weight): first the gradients of a graph's inputs, then, later, those of its
// weights, without computing anything twice.
//
// WeightPass::plan finds, for every weight, the nodes on the inputs' gradient paths where the
// weight's own path leaves them (e.g. the matmul whose other operand is the weight) and hooks them:
// the input pass (autograd::grad of the inputs, retaining the graph) captures their incoming
// gradients, and run() later starts autograd from exactly those nodes with the captured gradients,
// accumulating only into the weights.
//
// Checkpointed blocks (activation_checkpoint.h) are one node in the outer graph whose weights are
// reached only inside its recomputation. While a DeferWeights scope is active, such a
// block's backward recomputes its body, computes only its inputs' gradients, and leaves a
// WeightPass of the recomputed graph in the scope, to run with the outer one.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <vector>

namespace titan::nn {

class WeightPass {
 public:
  // Plans the weight pass of the graph that produced `output`, whose inputs are `inputs` (leaves
  // requiring grad) and weights `weights` (leaves requiring grad; empty: every other leaf of the
  // graph). Call before the input pass runs. Returns null when the split would compute a gradient
  // twice (a weight used at two points of one gradient path): back-propagate to the weights whole.
  static std::unique_ptr<WeightPass> plan(const at::Tensor& output, const std::vector<at::Tensor>& inputs,
                                          const std::vector<at::Tensor>& weights = {});
  ~WeightPass();
  // Accumulates the weights' gradients from what the input pass captured (once).
  void run();

  struct Group;

 private:
  WeightPass() = default;
  std::vector<std::unique_ptr<Group>> groups_;
  at::Tensor output_;  // keeps the graph alive until run()
};

// Collects the weight passes of checkpointed blocks back-propagated while it lives (see above); the
// scope is process-wide (autograd runs CUDA nodes on its own thread), so one input pass at a time
// may use it; nests (the innermost scope collects).
class DeferWeights {
 public:
  DeferWeights();
  ~DeferWeights();
  DeferWeights(const DeferWeights&) = delete;
  DeferWeights& operator=(const DeferWeights&) = delete;
  // The active scope, or null.
  static DeferWeights* current();
  void add(std::function<void()> weight_pass) { passes_.push_back(std::move(weight_pass)); }
  // What was collected, in the order it was (the caller runs them for its weight pass).
  std::vector<std::function<void()>> take() { return std::move(passes_); }
  // A checkpointed block whose split was impossible (WeightPass::plan null) back-propagated whole.
  void note_whole_backward() { ++whole_; }
  int whole_backwards() const { return whole_; }

 private:
  DeferWeights* previous_;
  std::vector<std::function<void()>> passes_;
  int whole_ = 0;
};

}  // namespace titan::nn
