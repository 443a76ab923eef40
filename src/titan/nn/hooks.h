// Forward hooks for titan's modules, like torch.nn.Module's: code outside the model (parallelisms)
// can run something before a module's forward and see (and replace) its output, without the model
// knowing. Modules that support hooks derive from HookedModule and wrap their forward body in
// with_hooks(). A module whose body is a function of its tensor inputs (with_hooks(inputs, body))
// can also have its body wrapped as a whole (activation checkpointing runs it without keeping
// activations and again in backward); the wrapper runs inside the pre- and post-hooks, so hooks run
// once per forward, not again when the body is recomputed. Input hooks (modules using
// with_hooks(inputs, body) only) replace the body's inputs before it runs: tensor parallelism
// gathers a sequence-sharded activation there; they run after the pre-hooks, outside the wrapper.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <vector>

namespace titan::nn {

class HookedModule : public torch::nn::Module {
 public:
  using PreHook = std::function<void()>;
  using PostHook = std::function<at::Tensor(const at::Tensor& output)>;
  using Body = std::function<at::Tensor(const std::vector<at::Tensor>& inputs)>;
  using Wrapper = std::function<at::Tensor(const Body& body, const std::vector<at::Tensor>& inputs)>;
  using InputHook = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;
  void add_forward_pre_hook(PreHook hook) { pre_hooks_.push_back(std::move(hook)); }
  void add_forward_input_hook(InputHook hook) { input_hooks_.push_back(std::move(hook)); }
  void add_forward_hook(PostHook hook) { post_hooks_.push_back(std::move(hook)); }
  // Replaces how the body runs (one wrapper per module); only for modules using with_hooks(inputs, body).
  void set_forward_wrapper(Wrapper wrapper) { wrapper_ = std::move(wrapper); }
  bool has_forward_wrapper() const { return static_cast<bool>(wrapper_); }

 protected:
  template <typename Body>
  at::Tensor with_hooks(Body&& body) {
    for (auto& h : pre_hooks_) h();
    at::Tensor out = body();
    for (auto& h : post_hooks_) out = h(out);
    return out;
  }
  at::Tensor with_hooks(std::vector<at::Tensor> inputs, const Body& body) {
    for (auto& h : pre_hooks_) h();
    for (auto& h : input_hooks_) inputs = h(inputs);
    at::Tensor out = wrapper_ ? wrapper_(body, inputs) : body(inputs);
    for (auto& h : post_hooks_) out = h(out);
    return out;
  }

 private:
  Wrapper wrapper_;
  std::vector<PreHook> pre_hooks_;
  std::vector<InputHook> input_hooks_;
  std::vector<PostHook> post_hooks_;
};

}  // namespace titan::nn
