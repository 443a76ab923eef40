// Forward hooks for titan's modules, like torch.nn.Module's: code outside the model (parallelisms)
// can run something before a module's forward and see (and replace) its output, without the model
// knowing. Modules that support hooks derive from HookedModule and wrap their forward body in
// with_hooks().
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
  void add_forward_pre_hook(PreHook hook) { pre_hooks_.push_back(std::move(hook)); }
  void add_forward_hook(PostHook hook) { post_hooks_.push_back(std::move(hook)); }

 protected:
  template <typename Body>
  at::Tensor with_hooks(Body&& body) {
    for (auto& h : pre_hooks_) h();
    at::Tensor out = body();
    for (auto& h : post_hooks_) out = h(out);
    return out;
  }

 private:
  std::vector<PreHook> pre_hooks_;
  std::vector<PostHook> post_hooks_;
};

}  // namespace titan::nn
