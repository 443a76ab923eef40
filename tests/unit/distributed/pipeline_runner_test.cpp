// The pipeline runner in one process (both stages on one rank: hand-overs, no messages), on graphs
// built here: a split backward (I then W) gives the gradients of one whole backward, also when the
// split is impossible (a weight used twice along one gradient path: I then runs the whole backward
// and W has nothing left) and when the last stage's body is checkpointed.
#include "test_util.h"

#include "titan/distributed/pipeline.h"
#include "titan/nn/activation_checkpoint.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace titan::dist {
namespace {

struct Weights {
  at::Tensor w0, w1;
};

Weights make_weights() {
  at::manual_seed(5);
  return {at::randn({8, 8}).requires_grad_(true), at::randn({8, 8}).requires_grad_(true)};
}

// Stage 0: tanh(x w0); stage 1: (h w1) w1 (twice along one path) or tanh(h w1), optionally checkpointed.
at::Tensor stage1(const Weights& w, const at::Tensor& h, bool twice) {
  return twice ? at::matmul(at::matmul(h, w.w1), w.w1) : at::tanh(at::matmul(h, w.w1));
}

void run_split(bool twice, bool checkpointed) {
  SCOPED_TRACE(std::string(twice ? "weight used twice" : "weight used once") + (checkpointed ? ", checkpointed" : ""));
  const at::Tensor x = at::randn({2, 4, 8}, at::TensorOptions().dtype(at::kFloat));
  // Reference: one whole backward of the two stages together.
  Weights ref = make_weights();
  stage1(ref, at::tanh(at::matmul(x, ref.w0)), twice).pow(2).sum().backward();

  Weights w = make_weights();
  CommBytes bytes, calls;
  Group pp("pp", {0}, 0, nullptr, &bytes, &calls);
  std::vector<PipelineStage> stages(2);
  stages[0].index = 0;
  stages[0].forward = [&](const at::Tensor& in) { return at::tanh(at::matmul(in, w.w0)); };
  stages[0].parameters = {w.w0};
  stages[1].index = 1;
  stages[1].forward = [&](const at::Tensor& in) {
    if (!checkpointed) return stage1(w, in, twice);
    return nn::checkpoint([&](const std::vector<at::Tensor>& a) { return stage1(w, a[0], twice); }, {in});
  };
  stages[1].parameters = {w.w1};
  PipelineOrder order = {{PipeAction{0, PipeOp::Forward, 0}, PipeAction{1, PipeOp::Forward, 0},
                          PipeAction{1, PipeOp::BackwardInput, 0}, PipeAction{0, PipeOp::BackwardInput, 0},
                          PipeAction{1, PipeOp::BackwardWeight, 0}, PipeAction{0, PipeOp::BackwardWeight, 0}}};
  PipelineRunner runner(pp, order, 2, 1, std::move(stages), at::TensorOptions().dtype(at::kFloat));
  runner.train_step({2, 4, 8}, [&](int) { return x; }, [](int, const at::Tensor& out) { return out.pow(2).sum(); });
  EXPECT_EQ(runner.weight_pass_fallbacks(), twice ? 1 : 0);
  ASSERT_TRUE(w.w0.grad().defined() && w.w1.grad().defined());
  EXPECT_LT(test::relative_error(w.w0.grad(), ref.w0.grad()), 1e-5);
  EXPECT_LT(test::relative_error(w.w1.grad(), ref.w1.grad()), 1e-5);
}

TEST(PipelineRunner, SplitBackwardEqualsOneBackward) {
  for (bool twice : {false, true})
    for (bool checkpointed : {false, true}) run_split(twice, checkpointed);
}

}  // namespace
}  // namespace titan::dist
