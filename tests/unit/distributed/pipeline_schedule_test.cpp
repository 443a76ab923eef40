// Pipeline schedules as data: generated orders against PyTorch's schedules, PyTorch's multi-stage
// schedules (interleaved, zero bubble, V-shaped) read back through the CSV format and accepted by
// the checker, and the checker's refusals (incomplete, duplicated, misplaced, deadlocking).
// Reference: tests/reference/pipeline_schedules.py (torch.distributed.pipelining's schedule classes).
#include "fuzz_regressions.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/distributed/pipeline_schedule.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <regex>

namespace titan::dist {
namespace {

// {"<name> pp=P spr=S m=M": rank -> cells}
const nlohmann::json& pytorch_orders() {
  static const nlohmann::json orders = [] {
    auto r = test::run_process({test::python(), std::string(TITAN_SOURCE_DIR) + "/tests/reference/pipeline_schedules.py"});
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return nlohmann::json::parse(r.output);
  }();
  return orders;
}

PipelineOrder from_json(const nlohmann::json& ranks) {
  PipelineOrder order(ranks.size());
  for (const auto& [rank, cells] : ranks.items())
    for (const auto& c : cells) order[std::stoi(rank)].push_back(parse_action(c.get<std::string>()));
  return order;
}

std::vector<std::string> cells(const std::vector<std::optional<PipeAction>>& row) {
  std::vector<std::string> out;
  for (const auto& a : row) out.push_back(a ? format_action(*a) : "");
  return out;
}

// A reference rank's actions without its idle slots: what titan's generators produce.
std::vector<std::string> actions_of(const nlohmann::json& ref_cells) {
  std::vector<std::string> out;
  for (const auto& c : ref_cells)
    if (!c.get<std::string>().empty()) out.push_back(c.get<std::string>());
  return out;
}

using test::error_of;

TEST(PipelineSchedule, GPipeIsPyTorchs) {
  for (int pp : {2, 4})
    for (int m : {4, 8}) {
      const auto& ref = pytorch_orders().at("GPipe pp=" + std::to_string(pp) + " spr=1 m=" + std::to_string(m));
      const PipelineOrder ours = gpipe_order(pp, m);
      ASSERT_EQ(ours.size(), static_cast<size_t>(pp));
      for (int r = 0; r < pp; ++r)
        EXPECT_EQ(cells(ours[r]), ref.at(std::to_string(r)).get<std::vector<std::string>>()) << "pp " << pp << " m " << m;
      EXPECT_NO_THROW(check_schedule(ours, pp, m));
    }
}

// 1F1B: the same order as PyTorch on every rank but the last. PyTorch's description of the last
// rank (its schedule IR, not what it executes) starts at F1 and ends at F<m>: it names a microbatch
// that does not exist and leaves out F0, which the checker refuses; titan's last rank alternates
// F0 B0 F1 B1 ..., what PyTorch's runtime does there.
TEST(PipelineSchedule, OneFOneBIsPyTorchsAndItsLastRankIsComplete) {
  for (int pp : {2, 4})
    for (int m : {4, 8}) {
      SCOPED_TRACE("pp " + std::to_string(pp) + " m " + std::to_string(m));
      const auto& ref = pytorch_orders().at("1F1B pp=" + std::to_string(pp) + " spr=1 m=" + std::to_string(m));
      const PipelineOrder ours = one_f_one_b_order(pp, m);
      for (int r = 0; r + 1 < pp; ++r) EXPECT_EQ(cells(ours[r]), ref.at(std::to_string(r)).get<std::vector<std::string>>());
      std::vector<std::string> last;
      for (int i = 0; i < m; ++i) {
        last.push_back(std::to_string(pp - 1) + "F" + std::to_string(i));
        last.push_back(std::to_string(pp - 1) + "B" + std::to_string(i));
      }
      EXPECT_EQ(cells(ours[pp - 1]), last);
      EXPECT_NO_THROW(check_schedule(ours, pp, m));
      EXPECT_NE(error_of([&] { check_schedule(from_json(ref), pp, m); }).find("but a step has microbatches 0.."),
                std::string::npos);
      // Warm-up of pp - 1 - r forwards: rank 0 holds at most pp activations at once.
      int alive = 0, most = 0;
      for (const auto& a : ours[0]) {
        alive += a->op == PipeOp::Forward ? 1 : -1;
        most = std::max(most, alive);
      }
      EXPECT_EQ(most, std::min(pp, m));
    }
  EXPECT_NO_THROW(check_schedule(one_f_one_b_order(4, 2), 4, 2));  // fewer microbatches than stages
}

// Interleaved 1F1B and interleaved zero bubble: the actions PyTorch's schedules run, in its order,
// per rank (PyTorch's idle slots left out: titan generates only what runs).
TEST(PipelineSchedule, InterleavedSchedulesArePyTorchs) {
  for (const bool zb : {false, true})
    for (int pp : {2, 4})
      for (int m : {4, 8}) {
        const std::string name = std::string(zb ? "InterleavedZeroBubble" : "Interleaved1F1B") + " pp=" +
                                 std::to_string(pp) + " spr=2 m=" + std::to_string(m);
        SCOPED_TRACE(name);
        const auto& ref = pytorch_orders().at(name);
        const PipelineOrder ours = interleaved_order(pp, 2, m, zb);
        ASSERT_EQ(ours.size(), static_cast<size_t>(pp));
        for (int r = 0; r < pp; ++r) {
          EXPECT_EQ(cells(ours[r]), actions_of(ref.at(std::to_string(r)))) << "rank " << r;
        }
        EXPECT_NO_THROW(check_schedule(ours, 2 * pp, m));
      }
  // Microbatches not a multiple of the rounds: 6 over 4 ranks is one round (fine), 10 over 4 is 2
  // rounds (fine), 9 over 4 is 2 rounds (refused).
  EXPECT_NO_THROW(check_schedule(interleaved_order(4, 2, 6, false), 8, 6));
  EXPECT_NO_THROW(check_schedule(interleaved_order(4, 2, 10, true), 8, 10));
  EXPECT_NE(error_of([] { interleaved_order(4, 2, 9, false); }).find("must be a multiple of 2"), std::string::npos);
  for (int pp : {1, 3})
    for (int spr : {1, 3})
      for (int m : {1, 2, 3, 5, 6})
        if (m % std::max(1, m / pp) == 0) {
          SCOPED_TRACE("pp " + std::to_string(pp) + " spr " + std::to_string(spr) + " m " + std::to_string(m));
          EXPECT_NO_THROW(check_schedule(interleaved_order(pp, spr, m, false), pp * spr, m));
          EXPECT_NO_THROW(check_schedule(interleaved_order(pp, spr, m, true), pp * spr, m));
        }
}

TEST(PipelineSchedule, ZbvIsPyTorchs) {
  for (int pp : {2, 4})
    for (int m : {4, 8}) {  // pp 4 with 4 microbatches: fewer than 2 pp - 1
      const std::string name = "ZBVZeroBubble pp=" + std::to_string(pp) + " spr=2 m=" + std::to_string(m);
      SCOPED_TRACE(name);
      const auto& ref = pytorch_orders().at(name);
      const PipelineOrder ours = zbv_order(pp, m);
      ASSERT_EQ(ours.size(), static_cast<size_t>(pp));
      for (int r = 0; r < pp; ++r) {
        EXPECT_EQ(cells(ours[r]), actions_of(ref.at(std::to_string(r)))) << "rank " << r;
      }
      EXPECT_NO_THROW(check_schedule(ours, 2 * pp, m));
    }
  for (int pp : {1, 3})
    for (int m : {1, 2, 5, 7}) EXPECT_NO_THROW(check_schedule(zbv_order(pp, m), 2 * pp, m)) << pp << " " << m;
}

// LoopedBFS: every rank's actions in PyTorch's order (its idle slots left out), with 2 and 3 stages
// per rank and one rank.
TEST(PipelineSchedule, LoopedBfsIsPyTorchs) {
  int checked = 0;
  for (const auto& [name, ref] : pytorch_orders().items()) {
    std::smatch m;
    if (!std::regex_match(name, m, std::regex("LoopedBFS pp=(\\d+) spr=(\\d+) m=(\\d+)"))) continue;
    SCOPED_TRACE(name);
    const int pp = std::stoi(m[1]), spr = std::stoi(m[2]), microbatches = std::stoi(m[3]);
    const PipelineOrder ours = looped_bfs_order(pp, spr, microbatches);
    ASSERT_EQ(ours.size(), static_cast<size_t>(pp));
    for (int r = 0; r < pp; ++r) EXPECT_EQ(cells(ours[r]), actions_of(ref.at(std::to_string(r)))) << "rank " << r;
    EXPECT_NO_THROW(check_schedule(ours, pp * spr, microbatches));
    ++checked;
  }
  EXPECT_EQ(checked, 6);
  // Breadth first holds every microbatch's activations of every local stage at the turn.
  const PipelineOrder bfs = looped_bfs_order(4, 2, 8);
  int alive = 0, most = 0;
  for (const auto& a : bfs[0]) {
    alive += a->op == PipeOp::Forward ? 1 : -1;
    most = std::max(most, alive);
  }
  EXPECT_EQ(most, 16);
}

// DualPipeV: PyTorch's order with each overlapped pair written forward then backward, from one to
// four ranks and with more microbatches than the pattern's minimum; fewer than 2 pp microbatches
// (which PyTorch refuses) is a clear error.
TEST(PipelineSchedule, DualPipeVIsPyTorchs) {
  int checked = 0;
  for (const auto& [name, ref] : pytorch_orders().items()) {
    std::smatch m;
    if (!std::regex_match(name, m, std::regex("DualPipeV pp=(\\d+) spr=2 m=(\\d+)"))) continue;
    SCOPED_TRACE(name);
    const int pp = std::stoi(m[1]), microbatches = std::stoi(m[2]);
    const PipelineOrder ours = dualpipev_order(pp, microbatches);
    ASSERT_EQ(ours.size(), static_cast<size_t>(pp));
    for (int r = 0; r < pp; ++r) EXPECT_EQ(cells(ours[r]), actions_of(ref.at(std::to_string(r)))) << "rank " << r;
    EXPECT_NO_THROW(check_schedule(ours, 2 * pp, microbatches));
    ++checked;
  }
  EXPECT_EQ(checked, 8);
  // Every rank holds at most 2 pp + 1 microbatches' activations of its half-size stages (ZBV: 2 pp).
  auto most_in_flight = [](const std::vector<std::optional<PipeAction>>& row) {
    int alive = 0, most = 0;
    for (const auto& a : row) {
      alive += a->op == PipeOp::Forward ? 1 : a->op == PipeOp::BackwardInput ? 0 : -1;
      most = std::max(most, alive);
    }
    return most;
  };
  for (int pp : {3, 4}) {
    const PipelineOrder dual = dualpipev_order(pp, 4 * pp - 1), zbv = zbv_order(pp, 4 * pp - 1);
    for (int r = 0; r < pp; ++r) {
      EXPECT_EQ(most_in_flight(dual[r]), 2 * pp + 1) << "pp " << pp << " rank " << r;
      EXPECT_EQ(most_in_flight(zbv[r]), 2 * pp) << "pp " << pp << " rank " << r;
    }
  }
  for (int pp : {2, 5, 8})
    for (int m : {2 * pp, 2 * pp + 1, 4 * pp}) EXPECT_NO_THROW(check_schedule(dualpipev_order(pp, m), 2 * pp, m)) << pp << " " << m;
  EXPECT_NE(error_of([] { dualpipev_order(4, 7); }).find("DualPipeV needs at least as many microbatches as stages (2 x 4 "
                                                         "pipeline ranks = 8), but a step has 7"),
            std::string::npos);
}

// The schedules' bubbles, from a simulation with equal forward costs and backward = 2 forwards, against
// the textbook figures: GPipe and 1F1B idle (p - 1) / (m + p - 1) of the step; interleaving v stages
// per rank divides the fill and drain by v: (p - 1) / (v m + p - 1) (m a multiple of p); the
// zero-bubble schedules, with F = I = W, idle less than 1F1B.
TEST(PipelineSchedule, SimulatedBubblesAreTheTextbookOnes) {
  for (int p : {2, 4})
    for (int m : {4, 8, 16}) {
      SCOPED_TRACE("p " + std::to_string(p) + " m " + std::to_string(m));
      const double textbook = static_cast<double>(p - 1) / (m + p - 1);
      for (const auto& order : {gpipe_order(p, m), one_f_one_b_order(p, m)}) {
        const ScheduleTiming t = simulate_schedule(order, p);
        EXPECT_DOUBLE_EQ(t.step_time, 3.0 * (m + p - 1));
        for (int r = 0; r < p; ++r) EXPECT_DOUBLE_EQ(1 - t.busy[r] / t.step_time, textbook) << "rank " << r;
        EXPECT_NEAR(t.bubble_fraction(), textbook, 1e-12);
      }
      const ScheduleTiming inter = simulate_schedule(interleaved_order(p, 2, m, false), 2 * p, {0.5, 1.0, 0.5, 0.5});
      EXPECT_NEAR(inter.bubble_fraction(), static_cast<double>(p - 1) / (2 * m + p - 1), 1e-12);
      // Breadth first idles as interleaving does: (p - 1) / (v m + p - 1).
      const ScheduleTiming bfs = simulate_schedule(looped_bfs_order(p, 2, m), 2 * p, {0.5, 1.0, 0.5, 0.5});
      EXPECT_NEAR(bfs.bubble_fraction(), static_cast<double>(p - 1) / (2 * m + p - 1), 1e-12);
      const ActionCosts equal{1, 2, 1, 1};
      const double one_f_one_b = simulate_schedule(one_f_one_b_order(p, m), p, equal).bubble_fraction();
      std::vector<PipelineOrder> zero_bubble = {interleaved_order(p, 2, m, true), zbv_order(p, m)};
      if (m >= 2 * p) zero_bubble.push_back(dualpipev_order(p, m));
      for (const auto& order : zero_bubble) {
        const double zb = simulate_schedule(order, 2 * p, {0.5, 1.0, 0.5, 0.5}).bubble_fraction();
        EXPECT_LT(zb, one_f_one_b);
      }
    }
  EXPECT_NE(error_of([] { simulate_schedule(parse_schedule_csv("0F0,0B0\n1B0,1F0\n"), 2); }).find("deadlocks"),
            std::string::npos);
}

TEST(PipelineSchedule, ByNameWithTorchtitansNames) {
  EXPECT_EQ(cells(schedule_by_name("1F1B", 4, 1, 8)[2]), cells(one_f_one_b_order(4, 8)[2]));
  EXPECT_EQ(cells(schedule_by_name("gpipe", 2, 1, 4)[1]), cells(gpipe_order(2, 4)[1]));
  EXPECT_EQ(cells(schedule_by_name("Interleaved1F1B", 2, 3, 4)[0]), cells(interleaved_order(2, 3, 4, false)[0]));
  EXPECT_EQ(cells(schedule_by_name("InterleavedZeroBubble", 2, 2, 4)[1]), cells(interleaved_order(2, 2, 4, true)[1]));
  EXPECT_EQ(cells(schedule_by_name("ZBVZeroBubble", 2, 2, 4)[0]), cells(zbv_order(2, 4)[0]));
  EXPECT_EQ(cells(schedule_by_name("LoopedBFS", 2, 3, 4)[1]), cells(looped_bfs_order(2, 3, 4)[1]));
  EXPECT_EQ(cells(schedule_by_name("dualpipev", 2, 2, 4)[0]), cells(dualpipev_order(2, 4)[0]));
  EXPECT_NE(error_of([] { schedule_by_name("1F1B", 2, 2, 4); }).find("runs one stage per rank, but the split gives 2"),
            std::string::npos);
  EXPECT_NE(error_of([] { schedule_by_name("ZBVZeroBubble", 2, 1, 4); }).find("runs two stages per rank"), std::string::npos);
  EXPECT_NE(error_of([] { schedule_by_name("DualPipeV", 2, 3, 6); }).find("runs two stages per rank, but the split "
                                                                         "gives 3 (set pipeline_parallel_layers_per_stage or "
                                                                         "pipeline_parallel_split_points accordingly, or "
                                                                         "choose Interleaved1F1B, LoopedBFS or "
                                                                         "InterleavedZeroBubble)"),
            std::string::npos);
  EXPECT_NE(error_of([] { schedule_by_name("BFS", 2, 2, 4); }).find("unknown parallelism.pipeline_parallel_schedule "
                                                                   "'BFS': titan runs GPipe, 1F1B, Interleaved1F1B, "
                                                                   "LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble and "
                                                                   "DualPipeV"),
            std::string::npos);
}

// PyTorch's multi-stage schedules, written as CSV and read back: the same cells, idle slots
// included, and a complete, deadlock-free step for the checker (with the split backward I + W).
TEST(PipelineSchedule, PyTorchsInterleavedAndZeroBubbleSchedulesRoundTripAndPass) {
  int checked = 0;
  for (const auto& [name, ranks] : pytorch_orders().items()) {
    if (name.rfind("GPipe", 0) == 0 || name.rfind("1F1B", 0) == 0) continue;
    SCOPED_TRACE(name);
    std::smatch m;
    ASSERT_TRUE(std::regex_search(name, m, std::regex("pp=(\\d+) spr=(\\d+) m=(\\d+)")));
    const int pp = std::stoi(m[1]), stages = pp * std::stoi(m[2]), microbatches = std::stoi(m[3]);
    const PipelineOrder order = from_json(ranks);
    const PipelineOrder again = parse_schedule_csv(schedule_csv(order));
    ASSERT_EQ(again.size(), order.size());
    for (size_t r = 0; r < order.size(); ++r) EXPECT_EQ(cells(again[r]), cells(order[r]));
    EXPECT_NO_THROW(check_schedule(order, stages, microbatches));
    const auto ranks_of = stage_ranks(order, stages);
    if (name.rfind("ZBV", 0) == 0 || name.rfind("DualPipeV", 0) == 0) {
      for (int s = 0; s < stages; ++s) EXPECT_EQ(ranks_of[s], s < pp ? s : stages - 1 - s) << "V shape";
    } else {
      for (int s = 0; s < stages; ++s) EXPECT_EQ(ranks_of[s], s % pp) << "looped";
    }
    ++checked;
  }
  EXPECT_EQ(checked, 26);
}

TEST(PipelineSchedule, BadSchedulesAreClearErrors) {
  auto check = [](const std::string& csv, int stages, int m) {
    return error_of([&] { check_schedule(parse_schedule_csv(csv, "s.csv"), stages, m); });
  };
  EXPECT_NE(check("0F0,0B0\n1B0,1F0\n", 2, 1).find("the ranks deadlock"), std::string::npos);
  EXPECT_NE(check("0F0,0B0\n1B0,1F0\n", 2, 1).find("rank 1 waits at 1B0 (action 1 of its row)"), std::string::npos);
  EXPECT_NE(check("0F0,0B0\n1F0\n", 2, 1).find("stage 1 microbatch 0 needs its backward once"), std::string::npos);
  EXPECT_NE(check("0F0,0I0\n", 1, 1).find("I without W"), std::string::npos);
  EXPECT_NE(check("0F0,0B0,0W0\n", 1, 1).find("(it has B and a split backward)"), std::string::npos);
  EXPECT_NE(check("0F0,0F0,0B0\n", 1, 1).find("0F0 appears more than once"), std::string::npos);
  EXPECT_NE(check("0F0,0B0\n0F1,0B1\n", 1, 2).find("stage 0 appears on rank 0 and on rank 1"), std::string::npos);
  EXPECT_NE(check("0F0,0B0\n", 2, 1).find("no rank runs stage 1"), std::string::npos);
  EXPECT_NE(check("0F0,0B0\n", 1, 2).find("never runs the forward of microbatch 1"), std::string::npos);
  EXPECT_NE(check("0F0,0W0,0I0\n", 1, 1).find("deadlock"), std::string::npos);  // W before its I
  EXPECT_EQ(check("0F0,0B0\n", 1, 1), "");
  EXPECT_EQ(check("0F0,,0B0\n\n", 1, 1), "");  // idle slots and a trailing empty line are fine
  // A last line of blanks is not a rank (tests/fuzz/regressions/pipeline_csv/blank_last_line_read_as_a_rank).
  EXPECT_EQ(parse_schedule_csv("0F0,0B0\n1F0,1B0\n\t \n", "s.csv").size(), 2u);
  const PipelineOrder found = parse_schedule_csv(test::fuzz_regression_files("pipeline_csv", "blank_last_line_read_as_a_rank")[0]);
  EXPECT_EQ(found.size(), 2u);
  EXPECT_EQ(parse_schedule_csv(schedule_csv(found)), found);
  EXPECT_EQ(check("0F0,0B0\n \n", 1, 1), "");
  EXPECT_NE(error_of([] { parse_schedule_csv("0F0,0SEND_F0\n", "s.csv"); }).find("s.csv:1 (rank 0): pipeline schedule: "
                                                                                 "'0SEND_F0' is a communication action"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_schedule_csv("0F0\n1X0\n", "s.csv"); }).find("s.csv:2 (rank 1): pipeline schedule: "
                                                                             "unknown operation 'X'"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_schedule_csv("0F\n", "s.csv"); }).find("it names no microbatch"), std::string::npos);
  EXPECT_NE(error_of([] { parse_schedule_csv("\n\n", "s.csv"); }).find("the pipeline schedule is empty"), std::string::npos);
  EXPECT_NE(error_of([] { read_schedule_csv("/nonexistent/schedule.csv"); }).find("cannot read the pipeline schedule"),
            std::string::npos);
}

}  // namespace
}  // namespace titan::dist
