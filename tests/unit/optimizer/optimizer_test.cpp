// Optimizer, learning-rate schedule and gradient clipping against PyTorch.
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/common/grad_norm.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/components/optimizer/lr_scheduler.h"
#include "titan/components/optimizer/optimizer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>

namespace titan {
namespace {

const std::string kScript = std::string(TITAN_SOURCE_DIR) + "/tests/reference/optim_reference.py";

TEST(LRSchedule, PastTheLastStepTheRateStaysAtItsEnd) {
  // A resumed schedule that was not restarted may run past its end: never below min_lr_factor.
  for (const std::string kind : {"linear", "sqrt", "cosine"}) {
    LRSchedule s(LRScheduleOptions{2, std::nullopt, kind, 0.1}, 10);
    EXPECT_GT(s.factor(9), 0.1) << kind;  // the last training step (torchtitan's schedule ends one later)
    EXPECT_NEAR(s.factor(10), 0.1, 1e-12) << kind;
    EXPECT_NEAR(s.factor(15), 0.1, 1e-12) << kind;
  }
}

TEST(LRSchedule, EqualsTorchtitansScheduleStepByStep) {
  // A grid over warmup / decay_ratio / decay type / min factor, including warmup > steps and
  // warmup + decay > steps, compared with LambdaLR driven by the schedule's definition.
  nlohmann::json cfgs = nlohmann::json::array();
  std::vector<LRScheduleOptions> opts;
  std::vector<int64_t> steps;
  for (int64_t total : {10, 37}) {
    for (int64_t warmup : {0, 2, 5, 50}) {
      for (auto ratio : {std::optional<double>{}, std::optional<double>{0.8}, std::optional<double>{0.25}}) {
        for (const char* kind : {"linear", "sqrt", "cosine"}) {
          for (double min_factor : {0.0, 0.1}) {
            LRScheduleOptions o{warmup, ratio, kind, min_factor};
            opts.push_back(o);
            steps.push_back(total);
            cfgs.push_back({{"warmup_steps", warmup}, {"decay_ratio", ratio ? nlohmann::json(*ratio) : nlohmann::json()},
                            {"decay_type", kind}, {"min_lr_factor", min_factor}, {"steps", total}, {"lr", 8e-4}});
          }
        }
      }
    }
  }
  test::TempDir dir;
  std::ofstream(dir / "in.json") << cfgs.dump();
  auto r = test::run_process({test::python(), kScript, "lr", dir / "in.json", dir / "out.json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  nlohmann::json expected = nlohmann::json::parse(std::ifstream(dir / "out.json"));
  ASSERT_EQ(expected.size(), opts.size());
  for (size_t c = 0; c < opts.size(); ++c) {
    LRSchedule schedule(opts[c], steps[c]);
    for (int64_t s = 0; s < steps[c]; ++s)
      ASSERT_NEAR(8e-4 * schedule.factor(s), expected[c][s].get<double>(), 1e-15)
          << "config " << cfgs[c].dump() << " training step " << s + 1;
  }
}

TEST(LRSchedule, DebugModelValues) {
  // llama3_debugmodel: lr 8e-4, warmup 2, decay_ratio 0.8, linear, 10 steps -> decay 8, stable 1.
  LRSchedule s({2, 0.8, "linear", 0.0}, 10);
  EXPECT_EQ(s.warmup_steps(), 2);
  EXPECT_EQ(s.decay_steps(), 8);
  EXPECT_EQ(s.stable_steps(), 1);
  EXPECT_DOUBLE_EQ(s.factor(0), 0.5);
  EXPECT_DOUBLE_EQ(s.factor(1), 1.0);
  EXPECT_DOUBLE_EQ(s.factor(2), 1.0);
  EXPECT_DOUBLE_EQ(s.factor(3), 1.0 - 1.0 / 8);
  EXPECT_THROW(LRSchedule({2, 0.8, "exponential", 0.0}, 10), UserError);
}

// max_norm > 0: each step's gradients clipped as torch.nn.utils.clip_grad_norm_ does, by the
// divisor the optimizer applies as it reads them (the trainer's way), on steps that clip and steps
// that do not.
class AdamParity : public ::testing::TestWithParam<std::tuple<std::string, std::string, double>> {};

TEST_P(AdamParity, MatchesTorchOptim) {
  const auto& [name, impl, max_norm] = GetParam();
  const int steps = 5;
  std::vector<at::Tensor> init = {at::randn({7, 5}), at::randn({11}), at::randn({3, 4, 2})};
  safetensors::Tensors in;
  for (size_t i = 0; i < init.size(); ++i) in["param." + std::to_string(i)] = init[i];
  for (int k = 0; k < steps; ++k)
    for (size_t i = 0; i < init.size(); ++i)  // norms about 4, 6, 8, 10, 13: the first steps unclipped
      in["grad." + std::to_string(k) + "." + std::to_string(i)] = at::randn_like(init[i]) * (0.5 + 0.25 * k);
  OptimizerOptions o;
  o.name = name;
  o.implementation = impl;
  o.lr = 1e-2;
  nlohmann::json cfg = {{"name", name}, {"lr", o.lr}, {"beta1", o.beta1}, {"beta2", o.beta2}, {"eps", o.eps},
                        {"weight_decay", o.weight_decay}, {"fused", impl == "fused"}, {"steps", steps},
                        {"max_norm", max_norm}};
  test::TempDir dir;
  safetensors::save(dir / "in.safetensors", in, {{"config", cfg.dump()}});
  auto r = test::run_process({test::python(), kScript, "adam", dir / "in.safetensors", dir / "out.safetensors"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto ref = safetensors::load(dir / "out.safetensors").tensors;

  std::vector<std::pair<std::string, at::Tensor>> named;
  for (size_t i = 0; i < init.size(); ++i) named.emplace_back(std::to_string(i), init[i].clone().requires_grad_(true));
  Optimizer opt(named, o);
  int clipped = 0;
  for (int k = 0; k < steps; ++k) {
    for (size_t i = 0; i < init.size(); ++i)
      named[i].second.mutable_grad() = in["grad." + std::to_string(k) + "." + std::to_string(i)].clone();
    std::vector<at::Tensor> grads;
    for (const auto& [n, p] : named) grads.push_back(p.grad());
    const at::Tensor norm = grad_sum_of_squares(grads).sqrt();
    clipped += max_norm > 0 && norm.item<double>() > max_norm;
    opt.step(std::nullopt, clip_divisor(norm, max_norm));
  }
  if (max_norm > 0) {
    EXPECT_TRUE(clipped > 0 && clipped < steps) << clipped << " of " << steps << " steps clipped";
  }
  auto state = opt.state_dict();
  // Same kernels (fused) or the same sequence of operations (for-loop): agreement to fp32 rounding.
  for (size_t i = 0; i < init.size(); ++i) {
    const std::string n = std::to_string(i);
    EXPECT_LT(test::relative_error(named[i].second, ref.at("param." + n)), 1e-6) << n;
    EXPECT_LT(test::relative_error(state.at(n + ".exp_avg"), ref.at("exp_avg." + n)), 1e-6) << n;
    EXPECT_LT(test::relative_error(state.at(n + ".exp_avg_sq"), ref.at("exp_avg_sq." + n)), 1e-6) << n;
    EXPECT_EQ(state.at(n + ".step").item<double>(), steps);
    EXPECT_GT(test::relative_error(named[i].second, init[i]), 1e-3) << "parameter did not move";
  }
}

INSTANTIATE_TEST_SUITE_P(All, AdamParity,
                         ::testing::Combine(::testing::Values("AdamW", "Adam"), ::testing::Values("fused", "for-loop"),
                                            ::testing::Values(0.0, 8.0)),
                         [](const auto& info) {
                           std::string n = std::get<0>(info.param) + "_" + std::get<1>(info.param) +
                                           (std::get<2>(info.param) > 0 ? "_clipped" : "");
                           for (auto& ch : n) if (ch == '-') ch = '_';
                           return n;
                         });

TEST(Optimizer, RejectsUnknownNamesAndStateOfAnotherModel) {
  std::vector<std::pair<std::string, at::Tensor>> p = {{"w", at::zeros({2}, at::requires_grad())}};
  EXPECT_THROW(Optimizer(p, OptimizerOptions{.name = "SGD"}), UserError);
  EXPECT_THROW(Optimizer(p, OptimizerOptions{.implementation = "foreach"}), UserError);
  Optimizer opt(p, {});
  EXPECT_THROW(opt.load_state_dict({{"v.exp_avg", at::zeros({2})}}), UserError);
}

TEST(ClipGradNorm, MatchesTheDefinition) {
  std::vector<at::Tensor> params = {at::zeros({3}, at::requires_grad()), at::zeros({2, 2}, at::requires_grad())};
  params[0].mutable_grad() = at::tensor({3.0f, 0.0f, 0.0f});
  params[1].mutable_grad() = at::full({2, 2}, 2.0f);  // total norm sqrt(9 + 16) = 5
  EXPECT_NEAR(clip_grad_norm(params, 1.0), 5.0, 1e-6);
  EXPECT_NEAR(params[0].grad()[0].item<double>(), 3.0 / (5.0 + 1e-6), 1e-6);
  EXPECT_NEAR(clip_grad_norm(params, 10.0), 1.0, 1e-5);  // already small: unchanged
  EXPECT_NEAR(params[1].grad()[0][0].item<double>(), 2.0 / (5.0 + 1e-6), 1e-6);
  // A reduction hook sees the local sum of squares (here: pretend another rank holds the same).
  double seen = 0;
  EXPECT_NEAR(clip_grad_norm(params, 0.0, [&](at::Tensor& s) { seen = s.item<double>(); s.mul_(2); }),
              std::sqrt(2.0), 1e-5);
  EXPECT_NEAR(seen, 1.0, 1e-5);
}

}  // namespace
}  // namespace titan
