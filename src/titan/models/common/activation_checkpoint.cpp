#include "titan/models/common/activation_checkpoint.h"

#include "titan/common/autocast.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
// Internal autograd API pinned to the torch version (2.11): a custom graph node (Node), its edges
// (collect_next_edges) and attaching it to an output (set_history).
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/autograd.h>

namespace titan::nn {
namespace {

using torch::autograd::variable_list;

// The backward of a checkpointed body: recompute it with a graph, then back-propagate the output's
// gradient through it (parameter gradients accumulate as usual; input gradients are returned).
struct CheckpointBackward : torch::autograd::Node {
  HookedModule::Body body;
  std::vector<at::Tensor> inputs;  // detached
  std::vector<bool> needs_grad;
  bool cuda_autocast = false;

  std::string name() const override { return "titan::nn::CheckpointBackward"; }

  variable_list apply(variable_list&& grads) override {
    std::vector<at::Tensor> in;
    for (size_t i = 0; i < inputs.size(); ++i)
      in.push_back(inputs[i].defined() ? inputs[i].detach().requires_grad_(needs_grad[i]) : inputs[i]);
    at::Tensor out;
    {
      at::AutoGradMode grad_mode(true);
      CudaBf16Autocast autocast(cuda_autocast);
      out = body(in);
    }
    torch::autograd::backward({out}, {grads[0]});
    variable_list result;
    for (size_t i = 0; i < in.size(); ++i) result.push_back(needs_grad[i] ? in[i].grad() : at::Tensor());
    inputs.clear();  // free the saved inputs as soon as they are no longer needed
    return result;
  }
};

}  // namespace

at::Tensor checkpoint(const HookedModule::Body& body, const std::vector<at::Tensor>& inputs) {
  if (!at::GradMode::is_enabled()) return body(inputs);
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = body(inputs);
  }
  auto node = std::shared_ptr<CheckpointBackward>(new CheckpointBackward(), torch::autograd::deleteNode);
  node->body = body;
  for (const auto& t : inputs) {
    node->inputs.push_back(t.defined() ? t.detach() : t);
    node->needs_grad.push_back(t.defined() && t.requires_grad());
  }
  node->cuda_autocast = at::autocast::is_autocast_enabled(at::kCUDA);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(out, node);
  return out;
}

void apply_activation_checkpointing(HookedModule& module) {
  module.set_forward_wrapper([](const HookedModule::Body& body, const std::vector<at::Tensor>& inputs) {
    return checkpoint(body, inputs);
  });
}

}  // namespace titan::nn
