// Activation checkpointing: a checkpointed block recomputes in backward exactly what the plain block
// computed, so losses and every gradient are bitwise those of the model without it; and its
// activations are not kept (fewer tensors alive between forward and backward).
#include "models/graph_memory.h"
#include "models/tiny_llama.h"
#include "test_util.h"

#include "titan/common/autocast.h"
#include "titan/nn/activation_checkpoint.h"
#include "titan/models/llama3/model.h"
#include "titan/models/registry.h"

#include <torch/csrc/autograd/function.h>

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace titan
