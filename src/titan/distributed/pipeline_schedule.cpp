#include "titan/distributed/pipeline_schedule.h"

#include "titan/common/error.h"
#include "titan/distributed/pipeline_comm.h"

#include <algorithm>
#include <cctype>
#include <deque>
#include <fstream>
#include <map>
#include <sstream>
#include <tuple>

namespace titan::dist {

std::string format_action(const PipeAction& a) {
  return std::to_string(a.stage) + static_cast<char>(a.op) + std::to_string(a.microbatch);
}

namespace {

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

bool all_digits(const std::string& s) {
  if (s.empty() || s.size() > 6) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

}  // namespace

std::optional<PipeAction> parse_action(const std::string& cell_in) {
  const std::string cell = trim(cell_in);
  if (cell.empty()) return std::nullopt;
  const size_t op_at = cell.find_first_not_of("0123456789");
  const std::string usage = "; a cell is empty (idle) or <stage><F|B|I|W><microbatch>, e.g. 2F0";
  TITAN_USER_CHECK(op_at != std::string::npos && op_at > 0, "pipeline schedule: cannot read the action '", cell, "'",
                   usage);
  const std::string stage = cell.substr(0, op_at), rest = cell.substr(op_at);
  for (const char* comm : {"UNSHARD", "RESHARD", "REDUCE_GRAD", "SEND_F", "RECV_F", "SEND_B", "RECV_B"})
    TITAN_USER_CHECK(rest.rfind(comm, 0) != 0, "pipeline schedule: '", cell, "' is a communication action; titan reads "
                     "compute-only schedules (F, B, I, W) and derives the sends, receives and FSDP's gathers itself",
                     usage);
  const char op = rest[0];
  TITAN_USER_CHECK(op == 'F' || op == 'B' || op == 'I' || op == 'W', "pipeline schedule: unknown operation '", op,
                   "' in '", cell, "'", usage);
  const std::string mb = rest.substr(1);
  TITAN_USER_CHECK(all_digits(stage) && all_digits(mb), "pipeline schedule: cannot read the action '", cell, "'",
                   mb.empty() ? " (it names no microbatch)" : "", usage);
  return PipeAction{std::stoi(stage), static_cast<PipeOp>(op), std::stoi(mb)};
}

PipelineOrder gpipe_order(int pp, int microbatches) {
  TITAN_USER_CHECK(pp >= 1 && microbatches >= 1, "GPipe needs at least one stage and one microbatch");
  PipelineOrder order(pp);
  for (int r = 0; r < pp; ++r) {
    for (int m = 0; m < microbatches; ++m) order[r].push_back(PipeAction{r, PipeOp::Forward, m});
    for (int m = 0; m < microbatches; ++m) order[r].push_back(PipeAction{r, PipeOp::Backward, m});
  }
  return order;
}

PipelineOrder one_f_one_b_order(int pp, int microbatches) {
  TITAN_USER_CHECK(pp >= 1 && microbatches >= 1, "1F1B needs at least one stage and one microbatch");
  PipelineOrder order(pp);
  for (int r = 0; r < pp; ++r) {
    // Warm-up: the forwards that fill the pipeline below this rank (fewer microbatches: all of them),
    // then alternate one forward and one backward, then drain the backwards.
    const int warmup = std::min(pp - 1 - r, microbatches);
    int f = 0, b = 0;
    for (; f < warmup; ++f) order[r].push_back(PipeAction{r, PipeOp::Forward, f});
    for (; f < microbatches; ++f, ++b) {
      order[r].push_back(PipeAction{r, PipeOp::Forward, f});
      order[r].push_back(PipeAction{r, PipeOp::Backward, b});
    }
    for (; b < microbatches; ++b) order[r].push_back(PipeAction{r, PipeOp::Backward, b});
  }
  return order;
}

PipelineOrder interleaved_order(int pp, int local_stages, int microbatches, bool zero_bubble) {
  const char* name = zero_bubble ? "InterleavedZeroBubble" : "Interleaved1F1B";
  TITAN_USER_CHECK(pp >= 1 && local_stages >= 1 && microbatches >= 1, name,
                   " needs at least one rank, one stage per rank and one microbatch");
  const int rounds = std::max(1, microbatches / pp);
  TITAN_USER_CHECK(microbatches % rounds == 0, name, ": ", microbatches, " microbatches over ", pp,
                   " pipeline ranks run in ", rounds, " rounds, so they must be a multiple of ", rounds,
                   " (choose parallelism.pipeline_parallel_microbatch_size accordingly)");
  const int per_round = microbatches / rounds;
  const int total = local_stages * microbatches;  // forwards (and backwards) per rank
  PipelineOrder order(pp);
  for (int r = 0; r < pp; ++r) {
    // Forwards before the first backward: enough to keep the last stage busy for the rounds of the
    // rank's earlier local stages, and more the further the rank is from the last one.
    const int warmup = std::min((local_stages - 1) * per_round + (zero_bubble ? 1 : 2) * (pp - 1 - r), total);
    // Op k's forward runs local stage (k / per_round) mod local_stages (depth first: a round of
    // microbatches goes through one local stage before the next); backwards go the other way.
    auto forward_stage = [&](int k) { return ((k / per_round) % local_stages) * pp + r; };
    auto backward_stage = [&](int k) { return (local_stages - 1 - ((k - warmup) / per_round) % local_stages) * pp + r; };
    std::map<int, int> next_forward, next_backward, next_weight;  // per stage: its next microbatch
    std::vector<int> weights_due;  // stages whose W comes next, in the order of their I
    size_t weights_done = 0;
    auto& row = order[r];
    auto weight = [&] {
      const int stage = weights_due[weights_done++];
      row.push_back(PipeAction{stage, PipeOp::BackwardWeight, next_weight[stage]++});
    };
    for (int k = 0; k < total + warmup; ++k) {
      if (k < total) {
        const int stage = forward_stage(k);
        row.push_back(PipeAction{stage, PipeOp::Forward, next_forward[stage]++});
      }
      if (k < warmup) continue;
      const int stage = backward_stage(k);
      row.push_back(PipeAction{stage, zero_bubble ? PipeOp::BackwardInput : PipeOp::Backward, next_backward[stage]++});
      if (!zero_bubble) continue;
      weights_due.push_back(stage);
      if (k - warmup >= r) weight();  // rank r defers its weight gradients by r backwards
    }
    while (weights_done < weights_due.size()) weight();
  }
  return order;
}

PipelineOrder zbv_order(int pp, int microbatches) {
  TITAN_USER_CHECK(pp >= 1 && microbatches >= 1, "ZBVZeroBubble needs at least one rank and one microbatch");
  // The pattern is laid out for at least 2 pp - 1 microbatches; with fewer, the actions of the
  // microbatches that do not exist are left out.
  const int n = std::max(2 * pp - 1, microbatches);
  PipelineOrder order(pp);
  for (int r = 0; r < pp; ++r) {
    const int down = r, up = 2 * pp - 1 - r;  // the V: stage r going down, 2 pp - 1 - r coming back
    int f_down = 0, f_up = 0, i_down = 0, i_up = 0, w_down = 0, w_up = 0;
    std::vector<PipeAction> ops;
    auto F = [&](int stage, int& count) { ops.push_back(PipeAction{stage, PipeOp::Forward, count++}); };
    auto I = [&](int stage, int& count) { ops.push_back(PipeAction{stage, PipeOp::BackwardInput, count++}); };
    auto W = [&](int stage, int& count) { ops.push_back(PipeAction{stage, PipeOp::BackwardWeight, count++}); };
    // Warm-up: fill the way down, then alternate up and down, then start the way back with each up
    // forward's backward at once.
    for (int k = 0; k < 2 * (pp - r) - 1; ++k) F(down, f_down);
    for (int k = 0; k < r; ++k) {
      F(up, f_up);
      F(down, f_down);
    }
    for (int k = 0; k < pp - r; ++k) {
      F(up, f_up);
      I(up, i_up);
      W(up, w_up);
    }
    // Steady state: one microbatch through both halves per round, weights right after their inputs.
    while (f_up < f_down || f_down < n) {
      if (f_down < n) F(down, f_down);
      I(down, i_down);
      W(down, w_down);
      F(up, f_up);
      I(up, i_up);
      W(up, w_up);
    }
    // Cool-down: input gradients first, weight gradients fill the gaps and the end.
    for (int k = 0; k < r; ++k) {
      I(down, i_down);
      I(up, i_up);
    }
    for (int k = 0; k < pp - r; ++k) {
      I(down, i_down);
      W(down, w_down);
    }
    while (w_up < i_up) W(up, w_up);
    while (w_down < i_down) W(down, w_down);
    for (const auto& a : ops)
      if (a.microbatch < microbatches) order[r].push_back(a);
  }
  return order;
}

PipelineOrder looped_bfs_order(int pp, int local_stages, int microbatches) {
  TITAN_USER_CHECK(pp >= 1 && local_stages >= 1 && microbatches >= 1,
                   "LoopedBFS needs at least one rank, one stage per rank and one microbatch");
  PipelineOrder order(pp);
  for (int r = 0; r < pp; ++r) {
    // Breadth first: every microbatch through one local stage before the next; then the backwards
    // from the last local stage back, the latest microbatch first.
    for (int k = 0; k < local_stages; ++k)
      for (int m = 0; m < microbatches; ++m) order[r].push_back(PipeAction{k * pp + r, PipeOp::Forward, m});
    for (int k = local_stages - 1; k >= 0; --k)
      for (int m = microbatches - 1; m >= 0; --m) order[r].push_back(PipeAction{k * pp + r, PipeOp::Backward, m});
  }
  return order;
}

PipelineOrder dualpipev_order(int pp, int microbatches) {
  TITAN_USER_CHECK(pp >= 1, "DualPipeV needs at least one rank");
  TITAN_USER_CHECK(microbatches >= 2 * pp, "DualPipeV needs at least as many microbatches as stages (2 x ", pp,
                   " pipeline ranks = ", 2 * pp, "), but a step has ", microbatches,
                   ": lower parallelism.pipeline_parallel_microbatch_size or raise training.local_batch_size");
  PipelineOrder order(pp);
  for (int r = 0; r < pp; ++r) {
    const int down = r, up = 2 * pp - 1 - r;  // the V, as ZBVZeroBubble
    std::map<int, int> next_forward, next_backward;  // per stage: its next microbatch
    std::deque<PipeAction> weights_due;             // the W of each I, in the order of the Is
    auto& row = order[r];
    auto F = [&](int stage) { row.push_back(PipeAction{stage, PipeOp::Forward, next_forward[stage]++}); };
    auto B = [&](int stage) { row.push_back(PipeAction{stage, PipeOp::Backward, next_backward[stage]++}); };
    auto I = [&](int stage) {
      row.push_back(PipeAction{stage, PipeOp::BackwardInput, next_backward[stage]++});
      weights_due.push_back(PipeAction{stage, PipeOp::BackwardWeight, row.back()->microbatch});
    };
    auto W = [&] {
      if (weights_due.empty()) return;
      row.push_back(weights_due.front());
      weights_due.pop_front();
    };
    const int below = pp - 1 - r;  // ranks after this one on the way down
    // Warm-up: fill the way down, then forwards down and up in turn, then the first way-up
    // microbatches' backward at once, split (I, then the W of the oldest I) so that W fills the gap.
    for (int k = 0; k < 2 * below; ++k) F(down);
    for (int k = 0; k <= r; ++k) {
      F(down);
      F(up);
    }
    for (int k = 0; k < below; ++k) {
      I(up);
      W();
      F(up);
    }
    // Steady state: pairs of one stage's forward with the other's backward (DualPipe overlaps the two
    // halves of a pair; here they run one after the other, forward first, as PyTorch's runtime does
    // without an overlap function).
    for (int k = 0; k < microbatches - 2 * pp + r + 1; ++k) {
      F(down);
      B(up);
      F(up);
      B(down);
    }
    for (int k = 0; k < below; ++k) {
      B(up);
      F(up);
      B(down);
    }
    // Cool-down: the last backwards, split into I and W from the middle one on (odd ranks switch one
    // action earlier), and the deferred Ws fill the end.
    bool split = false;
    for (int k = 0; k <= r; ++k) {
      if (k == (r + 1) / 2 && r % 2 == 1) split = true;
      split ? I(up) : B(up);
      if (k == (r + 1) / 2 && r % 2 == 0) split = true;
      split ? I(down) : B(down);
    }
    for (int k = 0; k < below; ++k) {
      W();
      I(down);
    }
    while (!weights_due.empty()) W();
  }
  return order;
}

PipelineOrder schedule_by_name(const std::string& name_in, int pp, int stages_per_rank, int microbatches) {
  std::string name = name_in;
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  auto need = [&](int stages, const char* which) {
    TITAN_USER_CHECK(stages_per_rank == stages, "parallelism.pipeline_parallel_schedule ", name_in, " runs ", which,
                     " per rank, but the split gives ", stages_per_rank, " (set pipeline_parallel_layers_per_stage or "
                     "pipeline_parallel_split_points accordingly, or choose ",
                     stages_per_rank == 1 ? "GPipe or 1F1B" : "Interleaved1F1B, LoopedBFS or InterleavedZeroBubble",
                     ")");
  };
  if (name == "gpipe") {
    need(1, "one stage");
    return gpipe_order(pp, microbatches);
  }
  if (name == "1f1b") {
    need(1, "one stage");
    return one_f_one_b_order(pp, microbatches);
  }
  if (name == "interleaved1f1b") return interleaved_order(pp, stages_per_rank, microbatches, false);
  if (name == "interleavedzerobubble") return interleaved_order(pp, stages_per_rank, microbatches, true);
  if (name == "loopedbfs") return looped_bfs_order(pp, stages_per_rank, microbatches);
  if (name == "zbvzerobubble") {
    need(2, "two stages");
    return zbv_order(pp, microbatches);
  }
  if (name == "dualpipev") {
    need(2, "two stages");
    return dualpipev_order(pp, microbatches);
  }
  throw UserError("unknown parallelism.pipeline_parallel_schedule '" + name_in + "': titan runs GPipe, 1F1B, "
                  "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble and DualPipeV, and any "
                  "schedule in a CSV file (parallelism.pipeline_parallel_schedule_csv)");
}

double ScheduleTiming::bubble_fraction() const {
  if (busy.empty() || step_time <= 0) return 0;
  double idle = 0;
  for (double b : busy) idle += 1 - b / step_time;
  return idle / static_cast<double>(busy.size());
}

namespace {

// Runs `order`: each rank starts its next action as soon as it is free and what the action needs
// (the previous stage's forward, the next stage's input gradient, its own forward, its own I before
// W) has ended. Idle slots of a CSV are skipped: only inputs make a rank wait. `next[r]` is where
// rank r stopped (its row's length when it finished; short of it, the ranks deadlock there).
struct Replay {
  ScheduleTiming timing;
  std::vector<size_t> next;
};

Replay replay(const PipelineOrder& order, int num_stages, const ActionCosts& costs) {
  Replay run;
  ScheduleTiming& t = run.timing;
  t.busy.assign(order.size(), 0);
  t.finish.assign(order.size(), 0);
  std::map<std::tuple<int, char, int>, double> end;  // when each action ended
  auto ended = [&](int s, PipeOp op, int m) -> std::optional<double> {
    auto it = end.find(std::make_tuple(s, static_cast<char>(op), m));
    if (it == end.end()) return std::nullopt;
    return it->second;
  };
  // When what `a` needs is done (nullopt: not yet).
  auto inputs_ready = [&](const PipeAction& a) -> std::optional<double> {
    switch (a.op) {
      case PipeOp::Forward:
        return a.stage == 0 ? std::optional<double>(0) : ended(a.stage - 1, PipeOp::Forward, a.microbatch);
      case PipeOp::Backward:
      case PipeOp::BackwardInput: {
        auto own = ended(a.stage, PipeOp::Forward, a.microbatch);
        if (!own || a.stage == num_stages - 1) return own;
        auto next = ended(a.stage + 1, PipeOp::Backward, a.microbatch);
        if (!next) next = ended(a.stage + 1, PipeOp::BackwardInput, a.microbatch);
        if (!next) return std::nullopt;
        return std::max(*own, *next);
      }
      case PipeOp::BackwardWeight:
        return ended(a.stage, PipeOp::BackwardInput, a.microbatch);
    }
    return std::nullopt;
  };
  auto cost = [&](PipeOp op) {
    switch (op) {
      case PipeOp::Forward: return costs.forward;
      case PipeOp::Backward: return costs.backward;
      case PipeOp::BackwardInput: return costs.backward_input;
      case PipeOp::BackwardWeight: return costs.backward_weight;
    }
    return 0.0;
  };
  std::vector<size_t>& next = run.next;
  next.assign(order.size(), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (size_t r = 0; r < order.size(); ++r) {
      for (; next[r] < order[r].size(); ++next[r]) {
        if (!order[r][next[r]]) continue;
        const PipeAction& a = *order[r][next[r]];
        const auto ready = inputs_ready(a);
        if (!ready) break;
        const double start = std::max(*ready, t.finish[r]);
        t.finish[r] = start + cost(a.op);
        t.busy[r] += cost(a.op);
        end[std::make_tuple(a.stage, static_cast<char>(a.op), a.microbatch)] = t.finish[r];
        progress = true;
      }
    }
  }
  for (size_t r = 0; r < order.size(); ++r) t.step_time = std::max(t.step_time, t.finish[r]);
  return run;
}

}  // namespace

ScheduleTiming simulate_schedule(const PipelineOrder& order, int num_stages, const ActionCosts& costs) {
  Replay run = replay(order, num_stages, costs);
  for (size_t r = 0; r < order.size(); ++r)
    TITAN_USER_CHECK(run.next[r] == order[r].size(), "simulate_schedule: the schedule deadlocks (check_schedule says where)");
  return std::move(run.timing);
}

std::string schedule_csv(const PipelineOrder& order) {
  std::string out;
  for (const auto& row : order) {
    for (size_t i = 0; i < row.size(); ++i) {
      if (i) out += ',';
      if (row[i]) out += format_action(*row[i]);
    }
    out += '\n';
  }
  return out;
}

PipelineOrder parse_schedule_csv(const std::string& text, const std::string& source) {
  PipelineOrder order;
  std::istringstream in(text);
  int line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::vector<std::optional<PipeAction>> row;
    // Every cell, trailing empty ones (idle slots at the end of a row) included; a blank line has none.
    for (size_t begin = 0; !trim(line).empty() && begin <= line.size();) {
      size_t end = line.find(',', begin);
      if (end == std::string::npos) end = line.size();
      const std::string cell = line.substr(begin, end - begin);
      begin = end + 1;
      try {
        row.push_back(parse_action(cell));
      } catch (const UserError& e) {
        throw UserError(source + ":" + std::to_string(line_no) + " (rank " + std::to_string(line_no - 1) + "): " + e.what());
      }
    }
    order.push_back(std::move(row));
  }
  // A final empty line is the end of the file, not a rank.
  while (!order.empty() && order.back().empty()) order.pop_back();
  TITAN_USER_CHECK(!order.empty(), source, ": the pipeline schedule is empty (one row of actions per pipeline rank)");
  return order;
}

PipelineOrder read_schedule_csv(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  TITAN_USER_CHECK(f.good(), "cannot read the pipeline schedule ", path,
                   " (parallelism.pipeline_parallel_schedule_csv): check the path");
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_schedule_csv(ss.str(), path);
}

std::vector<int> stage_ranks(const PipelineOrder& order, int num_stages) {
  TITAN_USER_CHECK(num_stages >= 1, "a pipeline needs at least one stage");
  std::vector<int> rank_of(num_stages, -1);
  for (size_t r = 0; r < order.size(); ++r)
    for (const auto& a : order[r]) {
      if (!a) continue;
      TITAN_USER_CHECK(a->stage >= 0 && a->stage < num_stages, "pipeline schedule: rank ", r, " runs ",
                       format_action(*a), ", but the model has stages 0..", num_stages - 1);
      TITAN_USER_CHECK(rank_of[a->stage] < 0 || rank_of[a->stage] == static_cast<int>(r), "pipeline schedule: stage ",
                       a->stage, " appears on rank ", rank_of[a->stage], " and on rank ", r,
                       "; each stage lives on one rank");
      rank_of[a->stage] = static_cast<int>(r);
    }
  for (int s = 0; s < num_stages; ++s)
    TITAN_USER_CHECK(rank_of[s] >= 0, "pipeline schedule: no rank runs stage ", s, " (the model has ", num_stages,
                     " stages)");
  return rank_of;
}

void check_schedule(const PipelineOrder& order, int num_stages, int microbatches) {
  TITAN_USER_CHECK(microbatches >= 1, "a pipeline schedule needs at least one microbatch");
  (void)stage_ranks(order, num_stages);
  // Every action once; B or I + W per (stage, microbatch).
  std::map<std::tuple<int, char, int>, int> seen;
  for (size_t r = 0; r < order.size(); ++r)
    for (const auto& a : order[r]) {
      if (!a) continue;
      TITAN_USER_CHECK(a->microbatch >= 0 && a->microbatch < microbatches, "pipeline schedule: rank ", r, " runs ",
                       format_action(*a), ", but a step has microbatches 0..", microbatches - 1);
      const int times = ++seen[std::make_tuple(a->stage, static_cast<char>(a->op), a->microbatch)];
      TITAN_USER_CHECK(times == 1, "pipeline schedule: ", format_action(*a), " appears more than once");
    }
  auto has = [&](int s, PipeOp op, int m) { return seen.count(std::make_tuple(s, static_cast<char>(op), m)) > 0; };
  auto name = [](int s, PipeOp op, int m) { return format_action(PipeAction{s, op, m}); };
  for (int s = 0; s < num_stages; ++s)
    for (int m = 0; m < microbatches; ++m) {
      TITAN_USER_CHECK(has(s, PipeOp::Forward, m), "pipeline schedule: stage ", s, " never runs the forward of "
                       "microbatch ", m, " (", name(s, PipeOp::Forward, m), ")");
      const bool full = has(s, PipeOp::Backward, m), input = has(s, PipeOp::BackwardInput, m),
                 weight = has(s, PipeOp::BackwardWeight, m);
      TITAN_USER_CHECK(full != (input || weight), "pipeline schedule: stage ", s, " microbatch ", m, " needs its "
                       "backward once: either ", name(s, PipeOp::Backward, m), ", or ",
                       name(s, PipeOp::BackwardInput, m), " and ", name(s, PipeOp::BackwardWeight, m),
                       full ? " (it has B and a split backward)" : " (it has none)");
      TITAN_USER_CHECK(full || (input && weight), "pipeline schedule: stage ", s, " microbatch ", m, " has ",
                       input ? "I without W" : "W without I", "; a split backward needs both");
    }
  // Run it: each rank executes its next action once what it needs is done.
  const std::vector<size_t> next = replay(order, num_stages, {}).next;
  std::string blocked;
  for (size_t r = 0; r < order.size(); ++r)
    if (next[r] < order[r].size())
      blocked += "\n  rank " + std::to_string(r) + " waits at " + format_action(*order[r][next[r]]) + " (action " +
                 std::to_string(next[r] + 1) + " of its row)";
  TITAN_USER_CHECK(blocked.empty(), "pipeline schedule: the ranks deadlock: each waits for an action another rank has "
                   "not run yet:", blocked);
  // The messages the runner posts for it, under NCCL's order matching.
  check_order_matching(communication_plan(order, num_stages));
}

}  // namespace titan::dist
