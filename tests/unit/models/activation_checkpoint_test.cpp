// Activation checkpointing: a checkpointed block recomputes in backward exactly what the plain block
// computed, so losses and every gradient are bitwise those of the model without it; and its
// activations are not kept (fewer tensors alive between forward and backward).
#include "models/graph_memory.h"
#include "models/tiny_llama.h"
#include "test_util.h"

#include "titan/common/autocast.h"
#include "titan/nn/activation_checkpoint.h"
#include "titan/models/llama3/model.h"
#include "titan/models/common/decoder.h"
#include "titan/models/registry.h"

#include <torch/csrc/autograd/function.h>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

namespace titan {
namespace {

llama3::ModelArgs tiny() { return test::tiny_llama(3, 101, 32); }

std::pair<double, std::map<std::string, at::Tensor>> loss_and_grads(llama3::Transformer& m, const at::Tensor& seq) {
  at::Tensor logits = m->forward(seq.slice(1, 0, 16));
  at::Tensor loss = at::cross_entropy_loss(logits.flatten(0, 1), seq.slice(1, 1, 17).flatten(0, 1));
  loss.backward();
  std::map<std::string, at::Tensor> grads;
  for (const auto& p : m->named_parameters()) grads[p.key()] = p.value().grad().clone();
  return {loss.item<double>(), grads};
}

TEST(ActivationCheckpoint, FullAndEverySecondBlockGiveBitwiseTheSameGradients) {
  at::Tensor seq = at::randint(101, {3, 17}, at::kLong);
  llama3::Transformer plain(tiny(), at::TensorOptions());
  plain->init_weights(4);
  auto [ref_loss, ref_grads] = loss_and_grads(plain, seq);
  for (const std::string mode : {"full", "selective"}) {
    llama3::Transformer m(tiny(), at::TensorOptions());
    m->init_weights(4);
    ParallelizeContext ctx;
    ctx.ac_mode = mode;
    ctx.ac_every = 2;
    model_spec("llama3").parallelize(*m, ctx);
    int wrapped = 0;
    for (const auto& [prefix, block] : m->blocks()) wrapped += block->has_forward_wrapper();
    EXPECT_EQ(wrapped, mode == "full" ? 3 : 1) << mode;  // selective 2: the 2nd block of 3
    auto [loss, grads] = loss_and_grads(m, seq);
    EXPECT_EQ(loss, ref_loss) << mode;
    for (const auto& [name, g] : ref_grads) EXPECT_TRUE(at::equal(grads.at(name), g)) << mode << " " << name;
  }
}

TEST(ActivationCheckpoint, TheBodyRunsAgainInBackwardAndKeepsOnlyItsInputs) {
  int calls = 0;
  at::Tensor w = at::randn({8, 8}).requires_grad_(true);
  nn::HookedModule::Body body = [&](const std::vector<at::Tensor>& in) {
    ++calls;
    return at::tanh(at::matmul(in[0], w)).sum(1);
  };
  at::Tensor x = at::randn({4, 8}).requires_grad_(true);
  at::Tensor out = nn::checkpoint(body, {x});
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(out.grad_fn()->name(), "titan::nn::CheckpointBackward");  // no tanh/matmul nodes kept
  out.sum().backward();
  EXPECT_EQ(calls, 2);
  at::Tensor xr = x.detach().requires_grad_(true), wr = w.detach().clone().requires_grad_(true);
  at::tanh(at::matmul(xr, wr)).sum(1).sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), xr.grad()));
  EXPECT_TRUE(at::equal(w.grad(), wr.grad()));
  // Without grad mode it simply runs the body.
  at::NoGradGuard no_grad;
  EXPECT_FALSE(nn::checkpoint(body, {x}).requires_grad());
}

// Per-operator policy: the matmuls and attention keep their outputs; the recomputation runs only the
// cheap operations. Losses and gradients equal the plain model's to fp32 rounding (a kept matmul's
// backward is written out, so its rounding may differ from ATen's by an ulp).
TEST(ActivationCheckpoint, PerOperatorPolicyGivesTheSameGradients) {
  at::Tensor seq = at::randint(101, {3, 17}, at::kLong);
  llama3::Transformer plain(tiny(), at::TensorOptions());
  plain->init_weights(4);
  auto [ref_loss, ref_grads] = loss_and_grads(plain, seq);
  llama3::Transformer m(tiny(), at::TensorOptions());
  m->init_weights(4);
  ParallelizeContext ctx;
  ctx.ac_mode = "op";
  model_spec("llama3").parallelize(*m, ctx);
  auto [loss, grads] = loss_and_grads(m, seq);
  EXPECT_NEAR(loss, ref_loss, 1e-6 * ref_loss);
  for (const auto& [name, g] : ref_grads) EXPECT_LT(test::relative_error(grads.at(name), g), 1e-5) << name;
}

// Attention's kernels counted: under a per-operator policy its forward kernel runs once (in the
// forward) and its backward kernel once; the body's cheap operations run twice. Gradients equal the
// plain computation's under both policies (which matmuls they keep: PerOperatorPolicies* below).
TEST(ActivationCheckpoint, PerOperatorPolicyRecomputesOnlyTheCheapOperations) {
  for (const auto save : {nn::SaveOps::EveryOtherMatmul, nn::SaveOps::AllMatmuls}) {
    SCOPED_TRACE(save == nn::SaveOps::AllMatmuls ? "all matmuls" : "every other matmul");
    int forwards = 0, backwards = 0, cheap = 0, plain = 0;
    nn::AttentionKernels counted = nn::causal_attention_kernels(), base = nn::causal_attention_kernels();
    counted.forward = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
      ++forwards;
      return base.forward(q, k, v);
    };
    counted.backward = [&](const at::Tensor& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& o, const at::Tensor& l) {
      ++backwards;
      return base.backward(g, q, k, v, o, l);
    };
    auto attend = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
      ++plain;
      return nn::causal_attention(q, k, v);
    };
    at::Tensor w1 = at::randn({16, 16}).requires_grad_(true), w2 = at::randn({16, 16}).requires_grad_(true),
               w3 = at::randn({16, 16}).requires_grad_(true);
    // x (B, S, 16) -> q, k, v (B, 2 heads, S, 8) -> attention -> back to (B, S, 16).
    auto heads = [](const at::Tensor& t) { return t.view({t.size(0), t.size(1), 2, 8}).transpose(1, 2); };
    nn::HookedModule::Body body = [&](const std::vector<at::Tensor>& in) {
      ++cheap;
      at::Tensor h = at::tanh(nn::saveable_linear(in[0], w1));
      at::Tensor g = nn::saveable_linear(h, w2);
      at::Tensor a = nn::saveable_attention(heads(h), heads(at::sin(h)), heads(g), attend, counted);
      return nn::saveable_linear(a.transpose(1, 2).reshape(h.sizes()), w3).sum(-1);
    };
    at::Tensor x = at::randn({2, 5, 16}).requires_grad_(true);
    at::Tensor out = nn::checkpoint(body, {x}, save);
    EXPECT_EQ(cheap, 1);
    EXPECT_EQ(forwards, 1);
    out.sum().backward();
    EXPECT_EQ(cheap, 2);      // the body ran again...
    EXPECT_EQ(forwards, 1);   // ...without attention's forward kernel
    EXPECT_EQ(backwards, 1);  // which back-propagated from the kept output and log-sum-exp
    EXPECT_EQ(plain, 0);
    at::Tensor xr = x.detach().requires_grad_(true), w1r = w1.detach().clone().requires_grad_(true),
               w2r = w2.detach().clone().requires_grad_(true), w3r = w3.detach().clone().requires_grad_(true);
    at::Tensor hr = at::tanh(at::linear(xr, w1r));
    at::Tensor ar = nn::causal_attention(heads(hr), heads(at::sin(hr)), heads(at::linear(hr, w2r)));
    at::linear(ar.transpose(1, 2).reshape(hr.sizes()), w3r).sum(-1).sum().backward();
    EXPECT_LT(test::relative_error(x.grad(), xr.grad()), 1e-5);
    EXPECT_LT(test::relative_error(w1.grad(), w1r.grad()), 1e-5);
    EXPECT_LT(test::relative_error(w2.grad(), w2r.grad()), 1e-5);
    EXPECT_LT(test::relative_error(w3.grad(), w3r.grad()), 1e-5);
  }
}

// Calls of one operator (by its name in the dispatcher) on every thread while the counter lives.
class OpCounter {
 public:
  explicit OpCounter(const char* name) {
    name_ = name;
    count_ = 0;
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback([](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
                                      if (std::strcmp(fn.name(), name_) == 0) ++count_;
                                      return nullptr;
                                    }).needsInputs(false).scopes({at::RecordScope::FUNCTION}));
  }
  ~OpCounter() { at::removeCallback(handle_); }
  int count() const { return count_; }

 private:
  static inline const char* name_ = "";
  static inline std::atomic<int> count_{0};
  at::CallbackHandle handle_;
};

// The model's blocks under the per-operator policies. Measured with the counting allocator: what the
// forward keeps for backward, torchtitan's policy (every other matmul) against all matmuls kept:
// less by exactly the outputs of the matmuls it recomputes, the 2nd, 4th and 6th of each block
// (wk: K x E, wo: dim, and one of w1/w3: hidden, per token). Attention's forward kernel runs in the
// forward only, under both policies: its output and log-sum-exp are kept, and the backward kernel
// runs from them (under full checkpointing the forward kernel runs again for every block).
TEST(ActivationCheckpoint, PerOperatorPoliciesKeepTorchtitansSetAndNeverRunAttentionAgain) {
  const auto args = tiny();
  at::Tensor seq = at::randint(101, {3, 16}, at::kLong);
  auto build = [&](const std::string& mode) {
    llama3::Transformer m(args, at::TensorOptions());
    m->init_weights(4);
    ParallelizeContext ctx;
    ctx.ac_mode = mode;
    model_spec("llama3").parallelize(*m, ctx);
    return m;
  };
  std::map<std::string, int64_t> saved;
  std::map<std::string, int> attention_in_backward;
  for (const std::string mode : {"op", "op_all_matmuls", "full"}) {
    llama3::Transformer m = build(mode);
    saved[mode] = test::measure_graph([&](const std::vector<at::Tensor>& in) { return m->forward(in[0]); }, {seq}).saved;
    at::Tensor out = m->forward(seq);
    OpCounter kernel("aten::_scaled_dot_product_flash_attention_for_cpu");
    out.sum().backward();
    attention_in_backward[mode] = kernel.count();
  }
  const int64_t E = args.dim / args.n_heads, hidden = 192;
  const int64_t recomputed = args.n_layers * 3 * 16 * (args.n_kv_heads * E + args.dim + hidden) * 4;
  EXPECT_EQ(saved["op_all_matmuls"] - saved["op"], recomputed);
  EXPECT_GT(saved["op"], saved["full"]);
  EXPECT_EQ(attention_in_backward["op"], 0);
  EXPECT_EQ(attention_in_backward["op_all_matmuls"], 0);
  EXPECT_EQ(attention_in_backward["full"], args.n_layers);  // the counter sees the kernel where it runs
}

// A checkpoint inside a per-operator body runs as one unit in both passes: its matmuls are not
// recorded on the outer tape, so the kept outputs after it line up in the recomputation.
TEST(ActivationCheckpoint, ACheckpointNestedInAPerOperatorBodyKeepsTheTapeAligned) {
  at::Tensor w1 = at::randn({8, 8}).requires_grad_(true), w2 = at::randn({8, 8}).requires_grad_(true);
  nn::HookedModule::Body inner = [&](const std::vector<at::Tensor>& in) { return at::tanh(nn::saveable_linear(in[0], w1)); };
  nn::HookedModule::Body body = [&](const std::vector<at::Tensor>& in) {
    at::Tensor h = nn::checkpoint(inner, {in[0]});
    return nn::saveable_linear(at::sin(h), w2) * nn::saveable_linear(h, w2);
  };
  at::Tensor x = at::randn({4, 8}).requires_grad_(true);
  nn::checkpoint(body, {x}, nn::SaveOps::AllMatmuls).sum().backward();
  at::Tensor xr = x.detach().requires_grad_(true), w1r = w1.detach().clone().requires_grad_(true),
             w2r = w2.detach().clone().requires_grad_(true);
  at::Tensor hr = at::tanh(at::linear(xr, w1r));
  (at::linear(at::sin(hr), w2r) * at::linear(hr, w2r)).sum().backward();
  EXPECT_LT(test::relative_error(x.grad(), xr.grad()), 1e-6);
  EXPECT_LT(test::relative_error(w1.grad(), w1r.grad()), 1e-6);
  EXPECT_LT(test::relative_error(w2.grad(), w2r.grad()), 1e-6);
}

TEST(ActivationCheckpoint, ASecondBackwardThroughACheckpointIsAClearError) {
  at::Tensor w = at::randn({8, 8}).requires_grad_(true);
  at::Tensor x = at::randn({4, 8}).requires_grad_(true);
  at::Tensor out = nn::checkpoint([&](const std::vector<at::Tensor>& in) { return at::tanh(at::matmul(in[0], w)); }, {x}).sum();
  out.backward({}, /*retain_graph=*/true);
  try {
    out.backward();
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("backward ran twice"), std::string::npos) << e.what();
  }
}

// The recomputation runs under the autocast state of the forward (CPU here, CUDA in training): the
// same bf16 matmuls, so the same gradients as without checkpointing.
TEST(ActivationCheckpoint, TheRecomputationRunsUnderTheForwardsAutocast) {
  at::Tensor w = at::randn({16, 16}).requires_grad_(true);
  at::Tensor x = at::randn({4, 16}).requires_grad_(true);
  nn::HookedModule::Body body = [&](const std::vector<at::Tensor>& in) { return at::tanh(at::matmul(in[0], w)); };
  at::Tensor ref_gx, ref_gw;
  {
    Bf16Autocast autocast(at::kCPU, true);
    at::Tensor out = body({x});
    EXPECT_EQ(out.scalar_type(), at::kBFloat16);
    out.to(at::kFloat).sum().backward();
  }
  ref_gx = x.grad().clone();
  ref_gw = w.grad().clone();
  x.mutable_grad() = at::Tensor();
  w.mutable_grad() = at::Tensor();
  at::Tensor out;
  {
    Bf16Autocast autocast(at::kCPU, true);
    out = nn::checkpoint(body, {x});
  }
  out.to(at::kFloat).sum().backward();  // backward outside the autocast scope, as the trainer does
  EXPECT_TRUE(at::equal(x.grad(), ref_gx));
  EXPECT_TRUE(at::equal(w.grad(), ref_gw));
}

// torchtitan's per_op_sac_force_recompute_mm_shapes_by_fqns: a named Linear is recomputed and does
// not move the every-other count. Three Linears a -> gate -> b -> c of different widths: with `gate`
// forced, every-other keeps a and c (1st and 3rd counted); without, a and b (gate counts as the 2nd).
// Measured by the counting allocator: what the forward keeps differs by exactly b's output.
// Under all_matmuls the forced gate's output is the one not kept.
class ThreeLinearsImpl : public nn::HookedModule {
 public:
  ThreeLinearsImpl() {
    a = register_module("a", nn::Linear(8, 32, at::TensorOptions()));
    gate = register_module("gate", nn::Linear(32, 3, at::TensorOptions()));
    b = register_module("b", nn::Linear(32, 24, at::TensorOptions()));
    c = register_module("c", nn::Linear(24, 5, at::TensorOptions()));
  }
  at::Tensor forward(const at::Tensor& x) {
    return with_hooks({x}, [this](const std::vector<at::Tensor>& in) {
      at::Tensor h = at::tanh(a(in[0]));
      at::Tensor g = at::sigmoid(gate(h)).sum(-1, true);
      return c(at::tanh(b(h) * g));
    });
  }
  nn::Linear a{nullptr}, gate{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(ThreeLinears);

TEST(ActivationCheckpoint, ForcedRecomputeLinearsAreNeitherKeptNorCounted) {
  const int64_t tokens = 2 * 7;
  at::Tensor x = at::randn({2, 7, 8});
  auto saved = [&](nn::SaveOps save, const std::vector<std::string>& forced) {
    ThreeLinears m;
    for (auto& p : m->parameters()) p.data().normal_();
    nn::force_recompute_linears(*m, "layers.0.", forced);
    const bool names_gate = std::any_of(forced.begin(), forced.end(),
                                        [](const std::string& f) { return std::string("layers.0.gate").find(f) != std::string::npos; });
    EXPECT_EQ(m->gate->recompute_under_op_policy, names_gate);
    EXPECT_FALSE(m->a->recompute_under_op_policy || m->b->recompute_under_op_policy || m->c->recompute_under_op_policy);
    nn::apply_activation_checkpointing(*m, save);
    // The gradients are those of the plain module whatever is kept.
    ThreeLinears plain;
    for (size_t i = 0; i < plain->parameters().size(); ++i) plain->parameters()[i].data().copy_(m->parameters()[i]);
    at::Tensor xr = x.clone().requires_grad_(true), xp = x.clone().requires_grad_(true);
    m->forward(xr).sum().backward();
    plain->forward(xp).sum().backward();
    EXPECT_TRUE(at::allclose(xr.grad(), xp.grad(), 1e-6, 1e-6));
    for (size_t i = 0; i < plain->parameters().size(); ++i)
      EXPECT_TRUE(at::allclose(m->parameters()[i].grad(), plain->parameters()[i].grad(), 1e-6, 1e-6));
    return test::measure_graph([&](const std::vector<at::Tensor>& in) { return m->forward(in[0]); },
                               {x.clone().requires_grad_(true)})
        .saved;
  };
  const int64_t f = sizeof(float);
  // (c's output is the module's output, alive whether kept or not.)
  EXPECT_EQ(saved(nn::SaveOps::EveryOtherMatmul, {}) - saved(nn::SaveOps::EveryOtherMatmul, {"moe.gate", "gate"}),
            tokens * 24 * f);
  EXPECT_EQ(saved(nn::SaveOps::AllMatmuls, {}) - saved(nn::SaveOps::AllMatmuls, {"gate"}), tokens * 3 * f);
  // A name that matches nothing changes nothing; one that matches a module other than a Linear is an error.
  EXPECT_EQ(saved(nn::SaveOps::EveryOtherMatmul, {"moe.router.gate"}), saved(nn::SaveOps::EveryOtherMatmul, {}));
  ThreeLinears m;
  const std::string e = test::error_of([&] { nn::force_recompute_linears(*m, "layers.0.", {"layers.0"}); });
  EXPECT_NE(e.find("activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns: 'layers.0' matches layers.0, "
                   "which is not a Linear layer"), std::string::npos) << e;
}

// The models wire it: torchtitan's default names every MoE layer's router gate (and nothing in a
// dense model); a name matching the router itself is refused when the model is parallelized.
TEST(ActivationCheckpoint, PerOperatorPolicyForcesTheRouterGatesOfMoEModels) {
  auto build = [](const std::vector<std::string>& forced) {
    LanguageModel m = model_spec("qwen3").build("debugmodel_moe", at::TensorOptions(), 128);
    ParallelizeContext ctx;
    config::ActivationCheckpoint ac;
    ac.selective_ac_option = "op";
    ac.per_op_sac_force_recompute_mm_shapes_by_fqns = forced;
    set_activation_checkpointing(ctx, ac);
    model_spec("qwen3").parallelize(*m, ctx);
    return m;
  };
  LanguageModel m = build(config::ActivationCheckpoint().per_op_sac_force_recompute_mm_shapes_by_fqns);
  int gates = 0, others = 0;
  for (const auto& item : m->named_modules()) {
    auto* linear = dynamic_cast<nn::LinearImpl*>(item.value().get());
    if (!linear) continue;
    const bool gate = item.key().find("moe.router.gate") != std::string::npos;
    EXPECT_EQ(linear->recompute_under_op_policy, gate) << item.key();
    (gate ? gates : others) += 1;
  }
  EXPECT_GT(gates, 0);
  EXPECT_GT(others, 0);
  const std::string e = test::error_of([&] { build({"moe.router"}); });
  EXPECT_NE(e.find("'moe.router' matches layers.0.moe.router, which is not a Linear layer"), std::string::npos) << e;
}

// determinism_check "default": a body that computes something of another shape when run again is
// stopped in backward with the block's name; with "none" nothing stops it.
TEST(ActivationCheckpoint, DeterminismCheckNamesABlockWhoseRecomputationDiffers) {
  at::Tensor w = at::randn({4, 4}).requires_grad_(true);
  nn::HookedModule::Body body = [&](const std::vector<at::Tensor>& in) {
    at::Tensor y = at::matmul(in[0], w);
    return nn::recomputing() ? y.sum(0) : y;  // recomputed: (4) instead of (3, 4)
  };
  auto error_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  nn::CheckpointOptions options;
  options.name = "layers.7";
  std::string e = error_of([&] { nn::checkpoint(body, {at::randn({3, 4}).requires_grad_(true)}, options).sum().backward(); });
  EXPECT_NE(e.find("activation checkpointing: recomputing layers.7 in backward gave an output of [4] Float on cpu where "
                   "its forward gave [3, 4] Float on cpu"), std::string::npos) << e;
  options.check_recompute = false;
  e = error_of([&] { nn::checkpoint(body, {at::randn({3, 4}).requires_grad_(true)}, options).sum().backward(); });
  EXPECT_EQ(e, "");  // autograd does not notice here (the sum's backward broadcasts): wrong gradients, silently
  // A body that recomputes what it computed passes the check.
  options.check_recompute = true;
  at::Tensor x = at::randn({3, 4}).requires_grad_(true);
  nn::checkpoint([&](const std::vector<at::Tensor>& in) { return at::matmul(in[0], w); }, {x}, options).sum().backward();
  EXPECT_TRUE(x.grad().defined());
}

}  // namespace
}  // namespace titan
