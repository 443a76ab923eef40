// Activation checkpointing: a checkpointed block recomputes in backward exactly what the plain block
// computed, so losses and every gradient are bitwise those of the model without it; and its
// activations are not kept (fewer tensors alive between forward and backward).
#include "models/tiny_llama.h"
#include "test_util.h"

#include "titan/common/autocast.h"
#include "titan/models/common/activation_checkpoint.h"
#include "titan/models/llama3/model.h"
#include "titan/models/registry.h"

#include <torch/csrc/autograd/function.h>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

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

TEST(ActivationCheckpoint, PerOperatorPolicyRecomputesOnlyTheCheapOperations) {
  int expensive = 0, cheap = 0;
  at::Tensor w1 = at::randn({8, 8}).requires_grad_(true), w2 = at::randn({8, 8}).requires_grad_(true);
  nn::HookedModule::Body body = [&](const std::vector<at::Tensor>& in) {
    ++cheap;
    at::Tensor h = at::tanh(nn::saveable_linear(in[0], w1));
    h = nn::saveable_op({h}, [&](const std::vector<at::Tensor>& a) {
      ++expensive;
      return at::softmax(a[0], -1);
    });
    return nn::saveable_linear(at::sin(h), w2).sum(1);
  };
  at::Tensor x = at::randn({4, 8}).requires_grad_(true);
  at::Tensor out = nn::checkpoint(body, {x}, /*save_ops=*/true);
  EXPECT_EQ(cheap, 1);
  EXPECT_EQ(expensive, 1);
  out.sum().backward();
  EXPECT_EQ(cheap, 2);      // the body ran again...
  EXPECT_EQ(expensive, 2);  // ...without the kept op: it ran once more only for its own backward
  at::Tensor xr = x.detach().requires_grad_(true), w1r = w1.detach().clone().requires_grad_(true),
             w2r = w2.detach().clone().requires_grad_(true);
  at::linear(at::sin(at::softmax(at::tanh(at::linear(xr, w1r)), -1)), w2r).sum(1).sum().backward();
  EXPECT_LT(test::relative_error(x.grad(), xr.grad()), 1e-6);
  EXPECT_LT(test::relative_error(w1.grad(), w1r.grad()), 1e-6);
  EXPECT_LT(test::relative_error(w2.grad(), w2r.grad()), 1e-6);
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
  nn::checkpoint(body, {x}, /*save_ops=*/true).sum().backward();
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
