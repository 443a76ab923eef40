#include "titan/nn/activation_checkpoint.h"

#include "titan/common/autocast.h"
#include "titan/common/error.h"
#include "titan/nn/float8.h"
#include "titan/nn/split_backward.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
// Internal autograd API pinned to the torch version (2.11): a custom graph node (Node), its edges
// (collect_next_edges) and attaching it to an output (set_history).
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <deque>
#include <sstream>

namespace titan::nn {
namespace {

using torch::autograd::variable_list;

// The outputs the per-operator policy keeps for one checkpointed call, in the order the body
// produces them: recorded by the forward (without grad), handed out again in the same order by the
// recomputation.
struct OpTape {
  enum class Mode { Record, Replay } mode = Mode::Record;
  bool all_matmuls = false;
  int64_t matmuls = 0;  // seen in the current pass (forward, then the recomputation): which are kept
  std::deque<at::Tensor> outputs;
  bool keeps_next_matmul() { return all_matmuls || ++matmuls % 2 == 1; }
};
thread_local OpTape* current_tape = nullptr;

struct TapeScope {
  OpTape* previous;
  explicit TapeScope(OpTape* tape) : previous(current_tape) { current_tape = tape; }
  ~TapeScope() { current_tape = previous; }
};

at::Tensor next_kept_output() {
  TORCH_CHECK(!current_tape->outputs.empty(), "activation checkpointing: the recomputation ran more kept operations "
              "than the forward (the checkpointed body must do the same operations every time)");
  // Detached: when the body's output is a kept output itself, the forward attached the checkpoint's
  // node to that tensor, and an edge from the replayed operation back to it would run the node again.
  at::Tensor out = current_tape->outputs.front().detach();
  current_tape->outputs.pop_front();
  return out;
}

// A matmul whose output was kept: forward hands out the kept output, backward is the linear's own.
struct KeptLinear : public torch::autograd::Function<KeptLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const at::Tensor& kept) {
    ctx->save_for_backward({x, weight});
    return kept.detach();
  }
  static variable_list backward(torch::autograd::AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    const at::Tensor g = grads[0];  // (..., out), the kept output's dtype (autocast's, under autocast)
    at::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) gx = at::matmul(g, w.to(g.scalar_type())).to(x.scalar_type());
    if (ctx->needs_input_grad(1))
      gw = at::mm(g.reshape({-1, g.size(-1)}).t(), x.to(g.scalar_type()).reshape({-1, x.size(-1)})).to(w.scalar_type());
    return {gx, gw, at::Tensor()};
  }
};

thread_local int recomputations = 0;  // checkpointed bodies being recomputed on this thread

// The backward of a checkpointed body: recompute it with a graph, then back-propagate the output's
// gradient through it (parameter gradients accumulate as usual; input gradients are returned).
struct CheckpointBackward : torch::autograd::Node {
  HookedModule::Body body;
  std::unique_ptr<OpTape> tape;  // per-operator policy: the kept outputs (null: recompute everything)
  std::vector<at::Tensor> inputs;  // detached
  std::vector<bool> needs_grad;
  bool cuda_autocast = false, cpu_autocast = false;
  bool released = false;  // the inputs are freed after the first backward
  // determinism_check: the forward output's metadata, which the recomputation's must match.
  bool check_recompute = false;
  std::string module_name;
  std::vector<int64_t> out_sizes;
  at::ScalarType out_dtype = at::kFloat;
  c10::Device out_device = c10::kCPU;

  std::string name() const override { return "titan::nn::CheckpointBackward"; }

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(!released, "activation checkpointing: backward ran twice through a checkpointed module (retain_graph); "
                "its saved inputs were freed after the first backward");
    released = true;
    std::vector<at::Tensor> in;
    for (size_t i = 0; i < inputs.size(); ++i)
      in.push_back(inputs[i].defined() ? inputs[i].detach().requires_grad_(needs_grad[i]) : inputs[i]);
    at::Tensor out;
    {
      at::AutoGradMode grad_mode(true);
      Bf16Autocast cuda(at::kCUDA, cuda_autocast), cpu(at::kCPU, cpu_autocast);
      if (tape) {
        tape->mode = OpTape::Mode::Replay;
        tape->matmuls = 0;
      }
      TapeScope scope(tape.get());
      ++recomputations;
      try {
        out = body(in);
      } catch (...) {
        --recomputations;
        throw;
      }
      --recomputations;
    }
    tape.reset();
    if (check_recompute) {
      auto describe = [](at::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) {
        std::ostringstream os;
        os << sizes << " " << c10::toString(dtype) << " on " << device;
        return os.str();
      };
      TORCH_CHECK(out.sizes() == at::IntArrayRef(out_sizes) && out.scalar_type() == out_dtype &&
                      out.device() == out_device,
                  "activation checkpointing: recomputing ", module_name, " in backward gave an output of ",
                  describe(out.sizes(), out.scalar_type(), out.device()), " where its forward gave ",
                  describe(out_sizes, out_dtype, out_device),
                  ": the recomputation must compute what the forward did (activation_checkpoint.determinism_check "
                  "= \"none\" skips this check)");
    }
    variable_list result;
    if (DeferWeights* defer = DeferWeights::current()) {
      // A split backward (zero-bubble pipeline schedules): the inputs' gradients now, the weights'
      // in the weight pass, from the recomputed graph kept until then.
      std::vector<at::Tensor> wanted;
      for (size_t i = 0; i < in.size(); ++i)
        if (needs_grad[i]) wanted.push_back(in[i]);
      if (std::shared_ptr<WeightPass> pass = WeightPass::plan(out, wanted)) {
        const variable_list g = torch::autograd::grad({out}, wanted, {grads[0]}, /*retain_graph=*/true,
                                                      /*create_graph=*/false, /*allow_unused=*/true);
        defer->add([pass] { pass->run(); });
        size_t k = 0;
        for (size_t i = 0; i < in.size(); ++i) result.push_back(needs_grad[i] ? g[k++] : at::Tensor());
        inputs.clear();
        return result;
      }
      defer->note_whole_backward();  // its weights' gradients come now, with the inputs'
    }
    torch::autograd::backward({out}, {grads[0]});
    for (size_t i = 0; i < in.size(); ++i) result.push_back(needs_grad[i] ? in[i].grad() : at::Tensor());
    inputs.clear();  // free the saved inputs as soon as they are no longer needed
    return result;
  }
};

}  // namespace

bool recomputing() { return recomputations > 0; }

namespace {

// Attaches `node` (recomputing `body` from `inputs` in backward) as the producer of `out`.
at::Tensor attach(at::Tensor out, std::shared_ptr<CheckpointBackward> node, const HookedModule::Body& body,
                  const std::vector<at::Tensor>& inputs) {
  node->body = body;
  for (const auto& t : inputs) {
    node->inputs.push_back(t.defined() ? t.detach() : t);
    node->needs_grad.push_back(t.defined() && t.requires_grad());
  }
  node->cuda_autocast = at::autocast::is_autocast_enabled(at::kCUDA);
  node->cpu_autocast = at::autocast::is_autocast_enabled(at::kCPU);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::set_history(out, node);
  return out;
}

std::shared_ptr<CheckpointBackward> new_node() {
  return std::shared_ptr<CheckpointBackward>(new CheckpointBackward(), torch::autograd::deleteNode);
}

}  // namespace

at::Tensor checkpoint(const HookedModule::Body& body, const std::vector<at::Tensor>& inputs, SaveOps save) {
  CheckpointOptions options;
  options.save = save;
  return checkpoint(body, inputs, options);
}

at::Tensor checkpoint(const HookedModule::Body& body, const std::vector<at::Tensor>& inputs,
                      const CheckpointOptions& options) {
  const SaveOps save = options.save;
  if (!at::GradMode::is_enabled()) {
    // Inside another checkpoint's forward (or without grad): run plainly, and record nothing on an
    // enclosing per-operator tape, since the recomputation will run this checkpoint as one.
    TapeScope none(nullptr);
    return body(inputs);
  }
  auto node = new_node();
  if (save != SaveOps::None) {
    node->tape = std::make_unique<OpTape>();
    node->tape->all_matmuls = save == SaveOps::AllMatmuls;
  }
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    TapeScope scope(node->tape.get());
    out = body(inputs);
  }
  node->check_recompute = options.check_recompute;
  if (options.check_recompute) {
    node->module_name = options.name;
    node->out_sizes = out.sizes().vec();
    node->out_dtype = out.scalar_type();
    node->out_device = out.device();
  }
  return attach(out, node, body, inputs);
}

at::Tensor saveable_linear(const at::Tensor& x, const at::Tensor& weight, const Float8Recipe* float8,
                           const Float8Sharding* float8_sharding, const Float8Weight* float8_weight) {
  auto linear = [&] {
    return float8 ? float8_linear(x, weight, *float8, {}, float8_sharding, float8_weight) : at::linear(x, weight);
  };
  // torchtitan's policy keeps every float8 matmul's output (_scaled_mm) and alternates only over the
  // plain ones (mm): a float8 matmul does not move the every-other counter.
  if (!current_tape || !(float8 || current_tape->keeps_next_matmul())) return linear();  // recomputed
  if (current_tape->mode == OpTape::Mode::Record) {
    at::Tensor out = linear();
    current_tape->outputs.push_back(out.detach());  // (the body may return it: no cycle through the node)
    return out;
  }
  return float8 ? float8_linear(x, weight, *float8, next_kept_output(), float8_sharding, float8_weight)
                : KeptLinear::apply(x, weight, next_kept_output());
}

namespace {

// An attention whose output and log-sum-exp were kept: forward hands out the kept output, backward
// runs the attention's backward kernel from them (the forward kernel does not run again).
struct KeptAttention : public torch::autograd::Function<KeptAttention> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                            const AttentionKernels* kernels) {
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["kernels"] = reinterpret_cast<int64_t>(kernels);
    return out.detach();
  }
  static variable_list backward(torch::autograd::AutogradContext* ctx, variable_list grads) {
    const auto* kernels = reinterpret_cast<const AttentionKernels*>(ctx->saved_data["kernels"].toInt());
    const auto s = ctx->get_saved_variables();
    auto [dq, dk, dv] = kernels->backward(grads[0], s[0], s[1], s[2], s[3], s[4]);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor saveable_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::function<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>& plain,
                              const AttentionKernels& kernels) {
  if (!current_tape) return plain(q, k, v);
  if (current_tape->mode == OpTape::Mode::Record) {
    auto [out, lse] = kernels.forward(q, k, v);
    current_tape->outputs.push_back(out.detach());
    current_tape->outputs.push_back(lse.detach());
    return out;
  }
  at::Tensor out = next_kept_output(), lse = next_kept_output();
  if (!at::GradMode::is_enabled()) return out;
  return KeptAttention::apply(q, k, v, out, lse, &kernels);
}

void apply_activation_checkpointing(HookedModule& module, const CheckpointOptions& options) {
  module.set_forward_wrapper([options](const HookedModule::Body& body, const std::vector<at::Tensor>& inputs) {
    return checkpoint(body, inputs, options);
  });
}

void apply_activation_checkpointing(HookedModule& module, SaveOps save) {
  CheckpointOptions options;
  options.save = save;
  apply_activation_checkpointing(module, options);
}

void force_recompute_linears(torch::nn::Module& module, const std::string& prefix, const std::vector<std::string>& fqns) {
  if (fqns.empty()) return;
  for (const auto& item : module.named_modules("", /*include_self=*/true)) {
    const std::string name = item.key().empty() && !prefix.empty() && prefix.back() == '.'
                                 ? prefix.substr(0, prefix.size() - 1)
                                 : prefix + item.key();
    const std::string* match = nullptr;
    for (const auto& f : fqns)
      if (name.find(f) != std::string::npos) match = &f;
    if (!match) continue;
    auto* linear = dynamic_cast<LinearImpl*>(item.value().get());
    TITAN_USER_CHECK(linear, "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns: '", *match,
                     "' matches ", name.empty() ? std::string("the model") : name, ", which is not a Linear layer; "
                     "name Linear layers only (e.g. moe.router.gate)");
    linear->recompute_under_op_policy = true;
  }
}

}  // namespace titan::nn
