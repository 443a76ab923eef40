#include "titan/distributed/pipeline_comm.h"

#include "titan/common/error.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

namespace titan::dist {

std::string format_message(const PipeMessage& m) {
  return std::string(m.gradient ? "gradient" : "activation") + " of microbatch " + std::to_string(m.microbatch) +
         " (stage " + std::to_string(m.from_stage()) + " -> " + std::to_string(m.stage) + ")";
}

CommPlan communication_plan(const PipelineOrder& order, int num_stages) {
  const std::vector<int> rank_of = stage_ranks(order, num_stages);
  const size_t n = order.size();
  CommPlan plan(n);
  std::vector<std::vector<P2POp>> pending(n);  // posted before the rank's next action
  auto post = [&](size_t r, const std::optional<PipeAction>& action) {
    // Every operation alone, in the order the messages were produced.
    PlanStep step;
    step.action = action;
    step.ops = std::move(pending[r]);
    pending[r].clear();
    plan[r].push_back(std::move(step));
  };
  // The ranks run in lockstep, each its next action once what it reads is done (as check_schedule's
  // replay). When an action produces a message for another rank, the send is posted by the producer
  // and the receive by the consumer before their next actions: both sides of every pair post their
  // messages in one order, the order they are produced in.
  std::set<std::tuple<int, char, int>> done;
  auto ended = [&](int s, PipeOp op, int m) { return done.count(std::make_tuple(s, static_cast<char>(op), m)) > 0; };
  auto ready = [&](const PipeAction& a) {
    switch (a.op) {
      case PipeOp::Forward: return a.stage == 0 || ended(a.stage - 1, PipeOp::Forward, a.microbatch);
      case PipeOp::Backward:
      case PipeOp::BackwardInput:
        return ended(a.stage, PipeOp::Forward, a.microbatch) &&
               (a.stage == num_stages - 1 || ended(a.stage + 1, PipeOp::Backward, a.microbatch) ||
                ended(a.stage + 1, PipeOp::BackwardInput, a.microbatch));
      case PipeOp::BackwardWeight: return ended(a.stage, PipeOp::BackwardInput, a.microbatch);
    }
    return false;
  };
  std::vector<size_t> next(n, 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < n; ++r) {
      while (next[r] < order[r].size() && !order[r][next[r]]) ++next[r];  // idle slots
      if (next[r] >= order[r].size() || !ready(*order[r][next[r]])) continue;
      const PipeAction a = *order[r][next[r]++];
      post(r, a);
      done.insert(std::make_tuple(a.stage, static_cast<char>(a.op), a.microbatch));
      progress = true;
      std::optional<PipeMessage> out;
      if (a.op == PipeOp::Forward && a.stage < num_stages - 1) out = PipeMessage{false, a.stage + 1, a.microbatch};
      if ((a.op == PipeOp::Backward || a.op == PipeOp::BackwardInput) && a.stage > 0)
        out = PipeMessage{true, a.stage - 1, a.microbatch};
      if (!out || rank_of[out->stage] == static_cast<int>(r)) continue;  // none, or a handoff on this rank
      const int to = rank_of[out->stage];
      pending[r].push_back({true, to, *out});
      pending[to].push_back({false, static_cast<int>(r), *out});
    }
  }
  for (size_t r = 0; r < n; ++r) {
    TITAN_ASSERT(next[r] == order[r].size(), "communication_plan of a schedule that deadlocks (check_schedule first)");
    if (!pending[r].empty()) post(r, std::nullopt);
  }
  return plan;
}

namespace {

std::string ordinal(size_t k) {
  const size_t n = k + 1;
  const char* suffix = (n % 100 >= 11 && n % 100 <= 13) ? "th" : n % 10 == 1 ? "st" : n % 10 == 2 ? "nd" : n % 10 == 3 ? "rd" : "th";
  return std::to_string(n) + suffix;
}

}  // namespace

void check_order_matching(const CommPlan& plan) {
  // Every posted operation, in posting order per rank; each waits for the computations posted before it.
  struct Posted {
    int rank;
    P2POp op;
    size_t computes_before;
    size_t partner = 0;  // the other end of its message
    bool done = false;
  };
  std::vector<Posted> posted;
  std::vector<std::vector<std::vector<size_t>>> needs(plan.size());  // per rank, per computation: its receives
  std::vector<std::vector<PipeAction>> computes(plan.size());
  std::map<std::pair<int, int>, std::vector<size_t>> stream;  // (rank, peer): operations in posting order
  // Per directed pair (from, to): the sends in `from`'s posting order and the receives in `to`'s.
  std::map<std::pair<int, int>, std::vector<size_t>> sends, recvs;
  for (size_t r = 0; r < plan.size(); ++r) {
    const int me = static_cast<int>(r);
    for (const auto& step : plan[r]) {
      std::vector<size_t> reads;
      for (const auto& op : step.ops) {
        const size_t id = posted.size();
        posted.push_back({me, op, computes[r].size()});
        stream[{me, op.peer}].push_back(id);
        if (op.send) {
          sends[{me, op.peer}].push_back(id);
        } else {
          recvs[{op.peer, me}].push_back(id);
          reads.push_back(id);
        }
      }
      if (step.action) {
        computes[r].push_back(*step.action);
        needs[r].push_back(std::move(reads));
      }
    }
  }
  // Order matching: the k-th send of a pair is the k-th receive of the other side.
  std::map<std::pair<int, int>, int> pairs;
  for (const auto& [key, list] : sends) pairs[key] = 0;
  for (const auto& [key, list] : recvs) pairs[key] = 0;
  const std::vector<size_t> none;
  for (const auto& [key, unused] : pairs) {
    const auto& [from, to] = key;
    const auto& out = sends.count(key) ? sends.at(key) : none;
    const auto& in = recvs.count(key) ? recvs.at(key) : none;
    for (size_t k = 0; k < std::min(out.size(), in.size()); ++k) {
      const PipeMessage& sent = posted[out[k]].op.message;
      const PipeMessage& expected = posted[in[k]].op.message;
      TITAN_USER_CHECK(sent == expected, "pipeline schedule: under NCCL's order matching (tags are ignored), rank ",
                       from, "'s ", ordinal(k), " send to rank ", to, " is the ", format_message(sent), ", but rank ",
                       to, "'s ", ordinal(k), " receive from rank ", from, " expects the ", format_message(expected),
                       ": two ranks must exchange their messages in one order (reorder the schedule so that stage ",
                       sent.stage, " runs its microbatches in the order stage ", sent.from_stage(), " produces them)");
      posted[out[k]].partner = in[k];
      posted[in[k]].partner = out[k];
    }
    TITAN_ASSERT(out.size() == in.size(), "pipeline plan: rank ", from, " sends ", out.size(), " messages to rank ", to,
                 ", which receives ", in.size());
  }
  // Run every stream until nothing moves: an operation runs when it heads its pair's stream and the
  // computations before it are done; a message passes when both its ends run.
  std::vector<size_t> done_computes(plan.size(), 0);
  std::map<std::pair<int, int>, size_t> head;
  auto running = [&](size_t id) {
    const Posted& p = posted[id];
    if (p.done || done_computes[p.rank] < p.computes_before) return false;
    return stream.at({p.rank, p.op.peer})[head[{p.rank, p.op.peer}]] == id;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < plan.size(); ++r) {
      while (done_computes[r] < computes[r].size()) {
        bool ready = true;
        for (size_t id : needs[r][done_computes[r]]) ready = ready && posted[id].done;
        if (!ready) break;
        ++done_computes[r];
        progress = true;
      }
    }
    for (size_t id = 0; id < posted.size(); ++id) {
      if (!running(id) || !running(posted[id].partner)) continue;
      for (size_t end : {id, posted[id].partner}) {
        posted[end].done = true;
        ++head[{posted[end].rank, posted[end].op.peer}];
      }
      progress = true;
    }
  }
  std::string blocked;
  for (size_t r = 0; r < plan.size(); ++r) {
    bool waits = false;
    for (const auto& [key, ops] : stream) {
      if (key.first != static_cast<int>(r) || head[key] >= ops.size()) continue;
      const Posted& p = posted[ops[head[key]]];
      blocked += "\n  rank " + std::to_string(r) + " with rank " + std::to_string(p.op.peer) + ": waits in " +
                 (p.op.send ? "send of the " : "receive of the ") + format_message(p.op.message);
      if (done_computes[r] < p.computes_before)
        blocked += " (posted after " + format_action(computes[r][p.computes_before - 1]) + ", which cannot run)";
      waits = true;
    }
    if (done_computes[r] < computes[r].size() && !waits)
      blocked += "\n  rank " + std::to_string(r) + ": " + format_action(computes[r][done_computes[r]]) +
                 " waits for its input";
  }
  TITAN_USER_CHECK(blocked.empty(), "pipeline schedule: under NCCL's rules (messages between two ranks match in "
                   "posting order on one stream; a send waits for its receive) the ranks deadlock:", blocked);
}

}  // namespace titan::dist
