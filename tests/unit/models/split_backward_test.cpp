// A backward split into the inputs' pass and the weights' pass (nn::WeightPass), as zero-bubble
// pipeline schedules run it: after the input pass only the inputs have gradients; the weight pass
// adds exactly the weights' gradients of one whole backward. Checkpointed bodies take part: under a
// DeferWeights scope their recomputation gives the inputs' gradients and leaves a weight pass, so
// the body runs once more in all (not once per pass).
#include "test_util.h"

#include "titan/nn/activation_checkpoint.h"
#include "titan/nn/split_backward.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

namespace titan {
namespace {

struct Case {
  at::Tensor x, w1, w2;
};

Case make_case() {
  at::manual_seed(3);
  return {at::randn({4, 8}).requires_grad_(true), at::randn({8, 8}).requires_grad_(true),
          at::randn({8, 8}).requires_grad_(true)};
}

at::Tensor body_of(const Case& c, const at::Tensor& x) {
  return nn::saveable_linear(at::tanh(nn::saveable_linear(x, c.w1)), c.w2);
}

// Gradients of one whole backward from `g`.
std::vector<at::Tensor> reference(const at::Tensor& g) {
  Case c = make_case();
  body_of(c, c.x).backward(g);
  return {c.x.grad(), c.w1.grad(), c.w2.grad()};
}

TEST(SplitBackward, WeightPassAddsTheWeightsGradientsAfterTheInputPass) {
  Case c = make_case();
  at::Tensor out = body_of(c, c.x);
  const at::Tensor g = at::randn(out.sizes());
  auto pass = nn::WeightPass::plan(out, {c.x}, {c.w1, c.w2});
  ASSERT_TRUE(pass);
  const auto dx = torch::autograd::grad({out}, {c.x}, {g}, /*retain_graph=*/true);
  EXPECT_FALSE(c.w1.grad().defined());
  EXPECT_FALSE(c.w2.grad().defined());
  pass->run();
  const auto ref = reference(g);
  EXPECT_LT(test::relative_error(dx[0], ref[0]), 1e-6);
  EXPECT_LT(test::relative_error(c.w1.grad(), ref[1]), 1e-6);
  EXPECT_LT(test::relative_error(c.w2.grad(), ref[2]), 1e-6);
}

TEST(SplitBackward, CheckpointedBodiesLeaveTheirWeightsToTheWeightPass) {
  for (const auto save : {nn::SaveOps::None, nn::SaveOps::EveryOtherMatmul}) {
    SCOPED_TRACE(save == nn::SaveOps::None ? "full recomputation" : "per operator");
    Case c = make_case();
    int runs = 0;
    nn::HookedModule::Body body = [&](const std::vector<at::Tensor>& in) {
      ++runs;
      return body_of(c, in[0]);
    };
    // A leaf before the checkpoint (the stage's input) and one after it, as in a pipeline stage.
    at::Tensor x = c.x.detach().requires_grad_(true);
    at::Tensor out = nn::checkpoint(body, {x * 1.0}, save) * 2.0;
    const at::Tensor g = at::randn(out.sizes());
    auto outer = nn::WeightPass::plan(out, {x}, {c.w1, c.w2});
    ASSERT_TRUE(outer);
    std::vector<std::function<void()>> deferred;
    torch::autograd::variable_list dx;
    {
      nn::DeferWeights defer;
      dx = torch::autograd::grad({out}, {x}, {g}, /*retain_graph=*/true);
      deferred = defer.take();
    }
    EXPECT_EQ(runs, 2);  // the forward and one recomputation
    EXPECT_FALSE(c.w1.grad().defined());
    EXPECT_FALSE(c.w2.grad().defined());
    ASSERT_EQ(deferred.size(), 1u);
    outer->run();
    for (auto& pass : deferred) pass();
    EXPECT_EQ(runs, 2);
    const auto ref = reference(g * 2.0);
    EXPECT_LT(test::relative_error(dx[0], ref[0]), 1e-6);
    EXPECT_LT(test::relative_error(c.w1.grad(), ref[1]), 1e-6);
    EXPECT_LT(test::relative_error(c.w2.grad(), ref[2]), 1e-6);
  }
}

// Without a scope, a checkpointed body's backward is whole (its weights' gradients at once).
TEST(SplitBackward, WithoutAScopeACheckpointedBodyBackPropagatesWhole) {
  Case c = make_case();
  at::Tensor x = c.x.detach().requires_grad_(true);
  at::Tensor out = nn::checkpoint([&](const std::vector<at::Tensor>& in) { return body_of(c, in[0]); }, {x * 1.0});
  const at::Tensor g = at::randn(out.sizes());
  torch::autograd::grad({out}, {x}, {g});
  EXPECT_TRUE(c.w1.grad().defined());
  EXPECT_LT(test::relative_error(c.w1.grad(), reference(g)[1]), 1e-6);
}

}  // namespace
}  // namespace titan
