#include "titan/components/optimizer/optimizer.h"

#include "titan/common/error.h"
#include "titan/common/grad_norm.h"

#include <ATen/ATen.h>

#include <cmath>
#include <functional>

namespace titan {

OptimizerOptions optimizer_options(const config::Optimizer& o) {
  TITAN_USER_CHECK(o.implementation != "foreach", "optimizer.implementation 'foreach' is not supported; use fused "
                   "(the default) or for-loop, which compute the same update");
  return OptimizerOptions{o.name, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.implementation};
}

Optimizer::Optimizer(std::vector<std::pair<std::string, at::Tensor>> named_params, OptimizerOptions opts)
    : opts_(std::move(opts)), lr_(opts_.lr) {
  TITAN_USER_CHECK(opts_.name == "AdamW" || opts_.name == "Adam", "optimizer.name '", opts_.name,
                   "' is not supported; choose AdamW or Adam");
  TITAN_USER_CHECK(opts_.implementation == "fused" || opts_.implementation == "for-loop",
                   "optimizer.implementation '", opts_.implementation,
                   "' is not supported; choose fused or for-loop");
  TITAN_USER_CHECK(opts_.lr >= 0 && opts_.eps >= 0 && opts_.weight_decay >= 0, "optimizer: lr, eps and weight_decay must be >= 0");
  TITAN_USER_CHECK(opts_.beta1 >= 0 && opts_.beta1 < 1 && opts_.beta2 >= 0 && opts_.beta2 < 1,
                   "optimizer: beta1 and beta2 must be in [0, 1)");
  decoupled_ = opts_.name == "AdamW";
  for (auto& [name, p] : named_params) {
    ParamState s;
    s.name = name;
    s.param = p;
    index_.emplace(p.unsafeGetTensorImpl(), params_.size());
    params_.push_back(std::move(s));
  }
}

void Optimizer::ensure_state() const {
  // Created at the first step (or when the state is read or loaded), as torch.optim does: start-up
  // does not pay for zero-filling twice the model's size.
  if (state_ready_) return;
  for (auto& s : params_) {
    s.exp_avg = at::zeros_like(s.param, at::MemoryFormat::Preserve);
    s.exp_avg_sq = at::zeros_like(s.param, at::MemoryFormat::Preserve);
    s.step = at::zeros({}, s.param.options().dtype(at::kFloat));
  }
  state_ready_ = true;
}

void Optimizer::zero_grad() {
  for (auto& s : params_) s.param.mutable_grad() = at::Tensor();
}

void Optimizer::step(const std::optional<at::Tensor>& skip, const at::Tensor& grad_divisor) {
  std::vector<ParamState*> all;
  for (auto& s : params_) all.push_back(&s);
  update(all, skip, grad_divisor);
  ++steps_;
}

void Optimizer::step_parameters(const std::vector<at::Tensor>& params, const std::optional<at::Tensor>& skip) {
  std::vector<ParamState*> states;
  for (const at::Tensor& p : params) {
    auto it = index_.find(p.unsafeGetTensorImpl());
    TITAN_ASSERT(it != index_.end(), "step_parameters: a tensor that is not one of the optimizer's parameters");
    states.push_back(&params_[it->second]);
  }
  update(states, skip);
}

void Optimizer::update(const std::vector<ParamState*>& states, const std::optional<at::Tensor>& skip,
                       const at::Tensor& grad_divisor) {
  at::NoGradGuard no_grad;
  ensure_state();
  if (opts_.implementation == "for-loop") {
    if (skip && skip->item<float>() != 0) return;  // this implementation reads the step on the host anyway
    std::map<std::string, at::Tensor> divisor_on;  // the divisor on each parameter device, copied once
    for (ParamState* s : states) {
      if (!s->param.grad().defined()) continue;
      if (grad_divisor.defined()) {
        at::Tensor& d = divisor_on[s->param.device().str()];
        if (!d.defined()) d = grad_divisor.to(s->param.device());
        s->param.mutable_grad().div_(d);
      }
      step_for_loop(*s);
    }
    return;
  }
  // The fused kernels take lists whose tensors share device and dtype.
  std::map<std::pair<std::string, at::ScalarType>, std::vector<ParamState*>> groups;
  for (ParamState* s : states)
    if (s->param.grad().defined()) groups[{s->param.device().str(), s->param.scalar_type()}].push_back(s);
  for (auto& [key, group] : groups) step_fused(group, skip, grad_divisor);
}

void Optimizer::step_fused(const std::vector<ParamState*>& group, const std::optional<at::Tensor>& skip,
                           const at::Tensor& grad_divisor) {
  std::vector<at::Tensor> params, grads, exp_avgs, exp_avg_sqs, steps;
  for (auto* s : group) {
    params.push_back(s->param);
    grads.push_back(s->param.grad());
    exp_avgs.push_back(s->exp_avg);
    exp_avg_sqs.push_back(s->exp_avg_sq);
    steps.push_back(s->step);
  }
  // The kernels read the already incremented step, as PyTorch's optimizer does: one multi-tensor
  // kernel for every step counter, not one launch per parameter.
  at::_foreach_add_(steps, 1);
  // found_inf (1.0: skip) is read by the kernels on the device, so skipping costs no host sync.
  std::optional<at::Tensor> found_inf;
  if (skip) found_inf = skip->to(params.front().device(), at::kFloat);
  // (the kernels divide each gradient by it as they read it, and store the quotient back: one more
  // write of the gradients, in place of a kernel that reads and writes them)
  std::optional<at::Tensor> grad_scale;
  if (grad_divisor.defined()) grad_scale = grad_divisor.to(params.front().device(), at::kFloat);
  if (decoupled_) {
    at::_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr_, opts_.beta1,
                      opts_.beta2, opts_.weight_decay, opts_.eps, /*amsgrad=*/false, /*maximize=*/false,
                      grad_scale, found_inf);
  } else {
    at::_fused_adam_(params, grads, exp_avgs, exp_avg_sqs, /*max_exp_avg_sqs=*/{}, steps, lr_, opts_.beta1,
                     opts_.beta2, opts_.weight_decay, opts_.eps, /*amsgrad=*/false, /*maximize=*/false,
                     grad_scale, found_inf);
  }
  if (found_inf) at::_foreach_sub_(steps, at::TensorList(std::vector<at::Tensor>(steps.size(), *found_inf)));
}

void Optimizer::step_for_loop(ParamState& s) {
  at::Tensor grad = s.param.grad();
  const double t = s.step.add_(1).item<double>();
  if (decoupled_) {
    s.param.mul_(1 - lr_ * opts_.weight_decay);
  } else if (opts_.weight_decay != 0) {
    grad = grad.add(s.param, opts_.weight_decay);
  }
  s.exp_avg.lerp_(grad, 1 - opts_.beta1);
  s.exp_avg_sq.mul_(opts_.beta2).addcmul_(grad, grad, 1 - opts_.beta2);
  const double bias1 = 1 - std::pow(opts_.beta1, t), bias2 = 1 - std::pow(opts_.beta2, t);
  at::Tensor denom = (s.exp_avg_sq.sqrt() / std::sqrt(bias2)).add_(opts_.eps);
  s.param.addcdiv_(s.exp_avg, denom, -lr_ / bias1);
}

std::vector<std::pair<std::string, at::Tensor>> Optimizer::named_parameters() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& s : params_) out.emplace_back(s.name, s.param);
  return out;
}

std::map<std::string, at::Tensor> Optimizer::state_dict() const {
  ensure_state();
  std::map<std::string, at::Tensor> out;
  for (const auto& s : params_) {
    out[s.name + ".exp_avg"] = s.exp_avg;
    out[s.name + ".exp_avg_sq"] = s.exp_avg_sq;
    out[s.name + ".step"] = s.step;
  }
  return out;
}

void Optimizer::load_state_dict(const std::map<std::string, at::Tensor>& state) {
  at::NoGradGuard no_grad;
  ensure_state();
  for (auto& s : params_) {
    const std::pair<const char*, at::Tensor*> entries[] = {
        {".exp_avg", &s.exp_avg}, {".exp_avg_sq", &s.exp_avg_sq}, {".step", &s.step}};
    for (const auto& [suffix, dst] : entries) {
      auto it = state.find(s.name + suffix);
      TITAN_USER_CHECK(it != state.end(), "optimizer state has no '", s.name, suffix,
                       "': the checkpoint was written for another model");
      TITAN_USER_CHECK(it->second.sizes() == dst->sizes(), "optimizer state '", s.name, suffix, "' has shape ",
                       it->second.sizes(), ", the parameter needs ", dst->sizes());
      dst->copy_(it->second);
    }
  }
}

double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm,
                      const std::function<void(at::Tensor&)>& reduce_sum_of_squares) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params)
    if (p.grad().defined()) grads.push_back(p.grad());
  if (grads.empty()) return 0.0;
  at::Tensor sum_sq = grad_sum_of_squares(grads);
  if (reduce_sum_of_squares) reduce_sum_of_squares(sum_sq);
  at::Tensor total = sum_sq.sqrt();
  scale_grads_to_norm(grads, total, max_norm);
  return total.item<double>();
}

}  // namespace titan
