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
  // Units: the operations, in posting order per rank; each waits for the computations posted before it.
  struct Unit {
    int rank, peer;
    std::vector<P2POp> ops;
    int computes_before;
    std::vector<bool> matched;
    int unmatched;
    bool done = false;
  };
  std::vector<Unit> units;
  std::vector<std::vector<std::vector<size_t>>> compute_needs(plan.size());  // per rank, per compute: units
  std::vector<std::vector<PipeAction>> computes(plan.size());
  std::map<std::pair<int, int>, std::vector<size_t>> queue;  // (rank, peer) -> units in posting order
  // Per directed pair (from, to): the sends in `from`'s posting order and the receives in `to`'s.
  std::map<std::pair<int, int>, std::vector<std::pair<size_t, size_t>>> sends, recvs;  // (unit, op)
  for (size_t r = 0; r < plan.size(); ++r) {
    const int me = static_cast<int>(r);
    for (const auto& step : plan[r]) {
      std::vector<size_t> needs;
      for (const auto& op : step.ops) {
        const std::vector<P2POp> batch{op};  // every operation alone on its pair's stream
        Unit u{me, op.peer, batch, static_cast<int>(computes[r].size()), std::vector<bool>(batch.size()),
               static_cast<int>(batch.size())};
        const size_t id = units.size();
        bool reads = false;
        for (size_t k = 0; k < batch.size(); ++k) {
          if (batch[k].send) {
            sends[{me, u.peer}].emplace_back(id, k);
          } else {
            recvs[{u.peer, me}].emplace_back(id, k);
            reads = true;
          }
        }
        units.push_back(std::move(u));
        queue[{me, units.back().peer}].push_back(id);
        if (reads) needs.push_back(id);
      }
      if (step.action) {
        computes[r].push_back(*step.action);
        compute_needs[r].push_back(std::move(needs));
      }
    }
  }
  // Order matching: the k-th send of a pair is the k-th receive of the other side.
  std::map<std::pair<size_t, size_t>, std::pair<size_t, size_t>> partner;
  std::map<std::pair<int, int>, int> pairs;
  for (const auto& [key, list] : sends) pairs[key] = 0;
  for (const auto& [key, list] : recvs) pairs[key] = 0;
  const std::vector<std::pair<size_t, size_t>> none;
  for (const auto& [key, unused] : pairs) {
    const auto& [from, to] = key;
    const auto& out = sends.count(key) ? sends.at(key) : none;
    const auto& in = recvs.count(key) ? recvs.at(key) : none;
    for (size_t k = 0; k < std::min(out.size(), in.size()); ++k) {
      const PipeMessage& sent = units[out[k].first].ops[out[k].second].message;
      const PipeMessage& expected = units[in[k].first].ops[in[k].second].message;
      TITAN_USER_CHECK(sent == expected, "pipeline schedule: under NCCL's order matching (tags are ignored), rank ",
                       from, "'s ", ordinal(k), " send to rank ", to, " is the ", format_message(sent), ", but rank ",
                       to, "'s ", ordinal(k), " receive from rank ", from, " expects the ", format_message(expected),
                       ": two ranks must exchange their messages in one order (reorder the schedule so that stage ",
                       sent.stage, " runs its microbatches in the order stage ", sent.from_stage(), " produces them)");
      partner[out[k]] = in[k];
      partner[in[k]] = out[k];
    }
    TITAN_ASSERT(out.size() == in.size(), "pipeline plan: rank ", from, " sends ", out.size(), " messages to rank ", to,
                 ", which receives ", in.size());
  }
  // Run every stream until nothing moves.
  std::vector<size_t> done_computes(plan.size(), 0);
  std::map<std::pair<int, int>, size_t> head;
  auto active = [&](size_t id) {
    const Unit& u = units[id];
    if (u.done || static_cast<int>(done_computes[u.rank]) < u.computes_before) return false;
    const auto& q = queue.at({u.rank, u.peer});
    return q[head[{u.rank, u.peer}]] == id;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < plan.size(); ++r) {
      while (done_computes[r] < computes[r].size()) {
        bool ready = true;
        for (size_t id : compute_needs[r][done_computes[r]]) ready = ready && units[id].done;
        if (!ready) break;
        ++done_computes[r];
        progress = true;
      }
    }
    for (size_t id = 0; id < units.size(); ++id) {
      if (!active(id)) continue;
      Unit& u = units[id];
      std::vector<size_t> touched{id};
      for (size_t k = 0; k < u.ops.size(); ++k) {
        if (u.matched[k]) continue;
        const auto [pid, pk] = partner.at({id, k});
        if (!active(pid)) continue;
        u.matched[k] = true;
        --u.unmatched;
        units[pid].matched[pk] = true;
        --units[pid].unmatched;
        touched.push_back(pid);
        progress = true;
      }
      for (size_t x : touched) {
        Unit& w = units[x];
        if (!w.done && w.unmatched == 0) {
          w.done = true;
          ++head[{w.rank, w.peer}];
          progress = true;
        }
      }
    }
  }
  std::string blocked;
  for (size_t r = 0; r < plan.size(); ++r) {
    for (const auto& [key, q] : queue) {
      if (key.first != static_cast<int>(r) || head[key] >= q.size()) continue;
      const Unit& u = units[q[head[key]]];
      std::string ops;
      for (size_t k = 0; k < u.ops.size(); ++k)
        if (!u.matched[k])
          ops += std::string(ops.empty() ? "" : ", ") + (u.ops[k].send ? "send of the " : "receive of the ") +
                 format_message(u.ops[k].message);
      blocked += "\n  rank " + std::to_string(r) + " with rank " + std::to_string(u.peer) + ": waits in " + ops;
      if (static_cast<int>(done_computes[r]) < u.computes_before)
        blocked += " (posted after " + format_action(computes[r][u.computes_before - 1]) + ", which cannot run)";
    }
    if (done_computes[r] < computes[r].size() && blocked.find("rank " + std::to_string(r) + " ") == std::string::npos)
      blocked += "\n  rank " + std::to_string(r) + ": " + format_action(computes[r][done_computes[r]]) +
                 " waits for its input";
  }
  TITAN_USER_CHECK(blocked.empty(), "pipeline schedule: under NCCL's rules (messages between two ranks match in "
                   "posting order on one stream; a send waits for its receive) the ranks deadlock:", blocked);
}

}  // namespace titan::dist
