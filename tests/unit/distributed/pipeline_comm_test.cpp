// The pipeline's point-to-point messages under NCCL's rules (pipeline_comm.h): every built-in
// schedule's plan matches and completes at pp 2-8, and so does any random order that respects the
// dependencies; receives posted where their action needs them (or the next action's before the
// current one's) are refused on schedules that NCCL would deadlock or swap microbatches on, naming
// the pair of ranks and the operations.
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/distributed/pipeline_comm.h"
#include "titan/distributed/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <random>
#include <set>
#include <tuple>

namespace titan::dist {
namespace {

using test::error_of;

TEST(PipelineComm, EveryBuiltInScheduleIsSafeUnderNcclOrderMatching) {
  int checked = 0;
  for (int pp = 2; pp <= 8; ++pp)
    for (int m : {pp, 2 * pp, 4 * pp, pp + 1, pp == 8 ? 64 : 1}) {
      SCOPED_TRACE("pp " + std::to_string(pp) + " m " + std::to_string(m));
      EXPECT_EQ(error_of([&] { check_order_matching(communication_plan(gpipe_order(pp, m), pp)); }), "") << "GPipe";
      EXPECT_EQ(error_of([&] { check_order_matching(communication_plan(one_f_one_b_order(pp, m), pp)); }), "") << "1F1B";
      EXPECT_EQ(error_of([&] { check_order_matching(communication_plan(zbv_order(pp, m), 2 * pp)); }), "") << "ZBV";
      checked += 3;
      for (int spr : {2, 3}) {
        EXPECT_EQ(error_of([&] { check_order_matching(communication_plan(looped_bfs_order(pp, spr, m), pp * spr)); }), "")
            << "LoopedBFS spr " << spr;
        ++checked;
      }
      if (m >= 2 * pp) {
        EXPECT_EQ(error_of([&] { check_order_matching(communication_plan(dualpipev_order(pp, m), 2 * pp)); }), "")
            << "DualPipeV";
        ++checked;
      }
      if (m % std::max(1, m / pp) != 0) continue;
      for (int spr : {2, 3})
        for (bool zb : {false, true}) {
          EXPECT_EQ(error_of([&] { check_order_matching(communication_plan(interleaved_order(pp, spr, m, zb), pp * spr)); }),
                    "")
              << (zb ? "InterleavedZeroBubble" : "Interleaved1F1B") << " spr " << spr;
          ++checked;
        }
    }
  EXPECT_GT(checked, 180);
}

// The plan posts every message once, alone, and both sides of every pair in one order: 1F1B at pp 2,
// rank 0 before 0B0 sends microbatch 1's activation (produced by 0F1) and receives microbatch 0's
// gradient (produced by 1B0 after that), in that order, as rank 1 receives and sends them.
TEST(PipelineComm, PlanPostsEachMessageAloneInTheOrderItIsProduced) {
  const CommPlan plan = communication_plan(one_f_one_b_order(2, 4), 2);
  ASSERT_EQ(plan.size(), 2u);
  // Rank 0: F0, F1, B0, F2, B1, F3, B2, B3.
  const PlanStep& b0 = plan[0][2];
  ASSERT_TRUE(b0.action);
  EXPECT_EQ(format_action(*b0.action), "0B0");
  ASSERT_EQ(b0.ops.size(), 2u);
  EXPECT_TRUE(b0.ops[0].send);
  EXPECT_EQ(format_message(b0.ops[0].message), "activation of microbatch 1 (stage 0 -> 1)");
  EXPECT_FALSE(b0.ops[1].send);
  EXPECT_EQ(format_message(b0.ops[1].message), "gradient of microbatch 0 (stage 1 -> 0)");
  // Per pair, rank 0's k-th operation and rank 1's k-th are the two ends of one message.
  std::vector<P2POp> zero, one;
  for (const auto& step : plan[0]) zero.insert(zero.end(), step.ops.begin(), step.ops.end());
  for (const auto& step : plan[1]) one.insert(one.end(), step.ops.begin(), step.ops.end());
  ASSERT_EQ(zero.size(), 8u);  // 4 activations sent, 4 gradients received
  ASSERT_EQ(one.size(), zero.size());
  for (size_t k = 0; k < zero.size(); ++k) {
    EXPECT_EQ(zero[k].message, one[k].message) << k;
    EXPECT_NE(zero[k].send, one[k].send) << k;
  }
}

// Plans that post receives where their action needs them instead of where the message is
// produced, every operation alone: each action's receives just before it and its sends just after;
// with `prefetch`, the next action's receives before the current action's too (so that on a rank's
// first action the receive for microbatch 1 goes out before microbatch 0's).
CommPlan naive_plan(const PipelineOrder& order, int num_stages, bool prefetch) {
  const std::vector<int> rank_of = stage_ranks(order, num_stages);
  CommPlan plan(order.size());
  for (size_t r = 0; r < order.size(); ++r) {
    const int me = static_cast<int>(r);
    std::vector<PipeAction> actions;
    for (const auto& a : order[r])
      if (a) actions.push_back(*a);
    auto reads = [&](const PipeAction& a) {
      std::vector<P2POp> ops;
      if (a.op == PipeOp::Forward && a.stage > 0 && rank_of[a.stage - 1] != me)
        ops.push_back({false, rank_of[a.stage - 1], {false, a.stage, a.microbatch}});
      if ((a.op == PipeOp::Backward || a.op == PipeOp::BackwardInput) && a.stage < num_stages - 1 &&
          rank_of[a.stage + 1] != me)
        ops.push_back({false, rank_of[a.stage + 1], {true, a.stage, a.microbatch}});
      return ops;
    };
    auto writes = [&](const PipeAction& a) {
      std::vector<P2POp> ops;
      if (a.op == PipeOp::Forward && a.stage < num_stages - 1 && rank_of[a.stage + 1] != me)
        ops.push_back({true, rank_of[a.stage + 1], {false, a.stage + 1, a.microbatch}});
      if ((a.op == PipeOp::Backward || a.op == PipeOp::BackwardInput) && a.stage > 0 && rank_of[a.stage - 1] != me)
        ops.push_back({true, rank_of[a.stage - 1], {true, a.stage - 1, a.microbatch}});
      return ops;
    };
    std::vector<bool> posted(actions.size(), false);
    for (size_t i = 0; i <= actions.size(); ++i) {
      PlanStep step;
      std::vector<P2POp> ops = i > 0 ? writes(actions[i - 1]) : std::vector<P2POp>{};
      for (size_t j : prefetch ? std::vector<size_t>{i + 1, i} : std::vector<size_t>{i}) {
        if (j >= actions.size() || posted[j]) continue;
        posted[j] = true;
        for (const auto& op : reads(actions[j])) ops.push_back(op);
      }
      step.ops = ops;
      if (i < actions.size()) step.action = actions[i];
      if (step.action || !step.ops.empty()) plan[r].push_back(std::move(step));
    }
  }
  return plan;
}

TEST(PipelineComm, PrefetchingTheNextReceiveBreaksUnderNccl) {
  // GPipe: rank 1 receives microbatch 1's activation where rank 0 sends microbatch 0's.
  const std::string gpipe = error_of([] { check_order_matching(naive_plan(gpipe_order(2, 4), 2, true)); });
  EXPECT_NE(gpipe.find("rank 0's 1st send to rank 1 is the activation of microbatch 0 (stage 0 -> 1), but rank 1's 1st "
                       "receive from rank 0 expects the activation of microbatch 1"),
            std::string::npos)
      << gpipe;
  // 1F1B at pp 2: rank 0 waits to receive microbatch 0's gradient before it sends microbatch 1's
  // activation, which rank 1 waits for before it sends that gradient.
  const std::string one_f_one_b = error_of([] { check_order_matching(naive_plan(one_f_one_b_order(2, 4), 2, true)); });
  EXPECT_NE(one_f_one_b.find("the ranks deadlock"), std::string::npos) << one_f_one_b;
  EXPECT_NE(one_f_one_b.find("rank 0 with rank 1: waits in receive of the gradient of microbatch 0 (stage 1 -> 0)"),
            std::string::npos)
      << one_f_one_b;
  EXPECT_NE(one_f_one_b.find("rank 1 with rank 0: waits in receive of the activation of microbatch 1 (stage 0 -> 1)"),
            std::string::npos)
      << one_f_one_b;
  // The plan the runner follows passes both.
  EXPECT_EQ(error_of([] { check_order_matching(communication_plan(gpipe_order(2, 4), 2)); }), "");
  EXPECT_EQ(error_of([] { check_order_matching(communication_plan(one_f_one_b_order(2, 4), 2)); }), "");
}

// Hand-made schedules that respect every dependency but break NCCL when each receive is posted
// where its action needs it: refused by the check, naming the pair and the operations. The runner's
// plan posts receives where messages are produced, so check_schedule accepts them: with that plan
// no schedule that passes the dependency check can fail NCCL's (RandomValidSchedulesAreSafe); the
// check guards the plan itself.
TEST(PipelineComm, SchedulesThatBreakNaivePostingAreRefusedThereAndSafeInThePlan) {
  // Rank 0 runs three forwards first; rank 1 sends microbatch 0's gradient before it receives
  // microbatch 1's activation. Both ranks sit in a send to the other, each waiting for a receive
  // the other posts later on the same stream.
  const PipelineOrder deadlock = parse_schedule_csv("0F0,0F1,0F2,0I0,0W0,0I1,0W1,0I2,0W2\n"
                                                    "1F0,1I0,1W0,1F1,1I1,1W1,1F2,1I2,1W2\n");
  const std::string error = error_of([&] { check_order_matching(naive_plan(deadlock, 2, false)); });
  EXPECT_NE(error.find("under NCCL's rules"), std::string::npos) << error;
  EXPECT_NE(error.find("rank 0 with rank 1: waits in send of the activation of microbatch 1 (stage 0 -> 1)"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("rank 1 with rank 0: waits in send of the gradient of microbatch 0 (stage 1 -> 0)"),
            std::string::npos)
      << error;
  EXPECT_EQ(error_of([&] { check_schedule(deadlock, 2, 3); }), "");
  // Stage 1 takes microbatch 1 before 0: Gloo's tags would sort the messages out, NCCL would hand
  // rank 1 microbatch 0's activation as microbatch 1's.
  const PipelineOrder swapped = parse_schedule_csv("0F0,0F1,0B0,0B1\n1F1,1F0,1B0,1B1\n");
  const std::string mismatch = error_of([&] { check_order_matching(naive_plan(swapped, 2, false)); });
  EXPECT_NE(mismatch.find("rank 0's 1st send to rank 1 is the activation of microbatch 0 (stage 0 -> 1), but rank 1's "
                          "1st receive from rank 0 expects the activation of microbatch 1"),
            std::string::npos)
      << mismatch;
  EXPECT_EQ(error_of([&] { check_schedule(swapped, 2, 2); }), "");
}

// Any order that respects the dependencies is safe under the plan: random schedules (a random
// topological order of every (stage, op, microbatch), split into the ranks' rows; looped or V
// stage placement, full or split backwards) at pp 2-4 pass the NCCL check.
TEST(PipelineComm, RandomValidSchedulesAreSafe) {
  std::mt19937 rng(12345);
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int pp = 2 + trial % 3, spr = 1 + (trial / 3) % 2, m = 1 + static_cast<int>(rng() % 6);
    const int stages = pp * spr;
    const bool split = rng() % 2, vee = spr == 2 && rng() % 2;
    auto rank_of = [&](int s) { return vee && s >= pp ? stages - 1 - s : s % pp; };
    std::set<std::tuple<int, char, int>> todo, done;
    for (int s = 0; s < stages; ++s)
      for (int mb = 0; mb < m; ++mb) {
        todo.insert({s, 'F', mb});
        if (split) {
          todo.insert({s, 'I', mb});
          todo.insert({s, 'W', mb});
        } else {
          todo.insert({s, 'B', mb});
        }
      }
    auto ready = [&](int s, char op, int mb) {
      auto has = [&](int st, char o) { return done.count({st, o, mb}) > 0; };
      if (op == 'F') return s == 0 || has(s - 1, 'F');
      if (op == 'W') return has(s, 'I');
      return has(s, 'F') && (s == stages - 1 || has(s + 1, 'B') || has(s + 1, 'I'));
    };
    PipelineOrder order(pp);
    while (!todo.empty()) {
      std::vector<std::tuple<int, char, int>> now;
      for (const auto& t : todo)
        if (ready(std::get<0>(t), std::get<1>(t), std::get<2>(t))) now.push_back(t);
      ASSERT_FALSE(now.empty());
      const auto pick = now[rng() % now.size()];
      todo.erase(pick);
      done.insert(pick);
      order[rank_of(std::get<0>(pick))].push_back(
          PipeAction{std::get<0>(pick), static_cast<PipeOp>(std::get<1>(pick)), std::get<2>(pick)});
    }
    EXPECT_EQ(error_of([&] { check_schedule(order, stages, m); }), "") << schedule_csv(order);
    ++checked;
  }
  EXPECT_EQ(checked, 300);
}

}  // namespace
}  // namespace titan::dist
