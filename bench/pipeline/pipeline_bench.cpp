// Pipeline schedules on CPU: where each rank's step goes (computing, or idle in the bubble), measured,
// against the schedule's theoretical bubble; and the activation memory each schedule holds.
//
// Two modes of one binary:
//
//   worker (one process per pipeline rank; bench/pipeline/run.sh starts them with torchrun's
//   environment variables, which the Trainer reads):
//     titan_pipeline_bench [--warmup N] [--measure N] [--round K] --out PREFIX  <titan train options...>
//   builds the Trainer from the same --job.config_file / --section.key options as `titan train`,
//   runs N warm-up steps, then N measured steps calling Trainer::train_step(), and writes
//   PREFIX.round<K>.rank<R>.json: per step the whole train_step's seconds, the runner's schedule seconds,
//   busy (computing actions), wait (blocked in receives), idle = schedule - busy, per-op compute
//   seconds and counts (F, B, I, W), and CPU tensor bytes: the peak above the step's start and the
//   bytes the forward passes had alive at that peak (the activations kept for backward).
//
//   summary (no processes, no model):
//     titan_pipeline_bench --summarize FILE.json...
//   groups the ranks' files by (pp, schedule, round) and prints a markdown table per pp, each figure
//   the median over rounds: the measured bubble (as simulate_schedule() defines it: per step, each
//   rank's share of the longest rank's schedule that it did not compute, averaged over ranks) next
//   to the textbook figure and to simulate_schedule() of the same order, once with unit costs
//   (F = I = W = 1, B = 2) and once with the per-op costs measured in the run.
#include "titan/common/error.h"
#include "titan/common/memory_tracker.h"
#include "titan/config/job_config.h"
#include "titan/distributed/pipeline.h"
#include "titan/distributed/pipeline_schedule.h"
#include "titan/tools/estimate.h"
#include "titan/trainer/trainer.h"

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

using namespace titan;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

const char kOps[] = {'F', 'B', 'I', 'W'};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<double> column(const json& steps, const std::string& key) {
  std::vector<double> out;
  for (const auto& s : steps) out.push_back(s.at(key).get<double>());
  return out;
}


// ---------------------------------------------------------------------------------------------
// Worker: one pipeline rank.

int run_worker(std::vector<std::string> args) {
  std::string v, out;
  int warmup = 3, measure = 10, round = 1;
  if (take_option(args, "--warmup", v)) warmup = std::stoi(v);
  if (take_option(args, "--measure", v)) measure = std::stoi(v);
  if (take_option(args, "--round", v)) round = std::stoi(v);
  TITAN_USER_CHECK(take_option(args, "--out", out), "--out PREFIX is required (each rank writes PREFIX.round<K>.rank<R>.json)");
  TITAN_USER_CHECK(warmup >= 1 && measure >= 1, "--warmup and --measure need at least one step each");
  const JobConfig cfg = parse_config(args);

  set_memory_budget_planner(memory_budget_plan);  // as titan train does (activation_checkpoint.mode memory_budget)
  Trainer trainer(cfg);
  const dist::PipelineRunner* runner = trainer.pipeline();
  TITAN_USER_CHECK(runner, "titan_pipeline_bench needs parallelism.pipeline_parallel_degree > 1");
  const int rank = trainer.launch_env().rank;
  const int pp = static_cast<int>(cfg.parallelism.pipeline_parallel_degree);

  // Warm-up: the optimizer's state is created at the first step, and the allocator's pools settle.
  for (int s = 0; s < warmup; ++s) trainer.train_step();

  json steps = json::array();
  for (int s = 0; s < measure; ++s) {
    // Parameters and optimizer state are alive before the step, and so are the last step's gradients
    // until the step's zero_grad() frees them; the backward passes then allocate them again. The start
    // is what is alive once they are freed, so the peak above it counts this step's gradients.
    int64_t grad_bytes = 0;
    for (const auto& p : trainer.parameters())
      if (p.local.grad().defined()) grad_bytes += static_cast<int64_t>(p.local.grad().nbytes());
    const int64_t start_bytes = mem::cpu_allocated_bytes() - grad_bytes;
    mem::reset_cpu_peak();
    const auto t0 = Clock::now();
    const StepResult r = trainer.train_step();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    const mem::PeakBreakdown peak = mem::cpu_peak_breakdown();
    const auto& t = runner->last_step_timing();
    json step = {{"train_step_seconds", seconds},
                 {"schedule_seconds", t.step_seconds},
                 {"busy_seconds", t.busy_seconds},
                 {"wait_seconds", t.wait_seconds},
                 {"idle_seconds", t.step_seconds - t.busy_seconds},
                 {"idle_fraction", (t.step_seconds - t.busy_seconds) / t.step_seconds},
                 {"wait_fraction", t.wait_seconds / t.step_seconds},
                 {"peak_above_start_bytes", peak.peak_bytes - start_bytes},
                 {"forward_bytes_at_peak", peak.alive_by_phase[static_cast<size_t>(mem::Phase::Forward)]},
                 {"phase_at_peak", mem::phase_name(peak.phase_at_peak)},
                 {"gradient_bytes", grad_bytes},
                 {"loss", r.loss}};
    json ops = json::object();
    for (const auto& [op, sc] : t.per_op) ops[std::string(1, op)] = {{"seconds", sc.first}, {"count", sc.second}};
    step["per_op"] = ops;
    steps.push_back(step);
  }

  // Medians over the measured steps (per-op: seconds per action).
  json med = json::object();
  for (const char* key : {"train_step_seconds", "schedule_seconds", "busy_seconds", "wait_seconds", "idle_seconds",
                          "idle_fraction", "wait_fraction", "peak_above_start_bytes", "forward_bytes_at_peak"})
    med[key] = median(column(steps, key));
  json op_cost = json::object();
  for (char op : kOps) {
    std::vector<double> per_action;
    for (const auto& s : steps) {
      const std::string k(1, op);
      if (!s["per_op"].contains(k)) continue;
      per_action.push_back(s["per_op"][k]["seconds"].get<double>() / s["per_op"][k]["count"].get<int>());
    }
    if (!per_action.empty()) op_cost[std::string(1, op)] = median(per_action);
  }
  med["op_seconds_per_action"] = op_cost;

  const json doc = {{"schedule", cfg.parallelism.pipeline_parallel_schedule},
                    {"pp", pp},
                    {"rank", rank},
                    {"round", round},
                    {"num_stages", runner->num_stages()},
                    {"stages_per_rank", runner->num_stages() / pp},
                    {"microbatches", runner->microbatches()},
                    {"seq_len", cfg.training.seq_len},
                    {"local_batch_size", cfg.training.local_batch_size},
                    {"warmup", warmup},
                    {"weight_pass_fallbacks", runner->weight_pass_fallbacks()},
                    {"median", med},
                    {"steps", steps}};
  const std::string path = out + ".round" + std::to_string(round) + ".rank" + std::to_string(rank) + ".json";
  std::ofstream f(path);
  TITAN_USER_CHECK(f.good(), "cannot write ", path);
  f << doc.dump(1) << "\n";
  return 0;
}

// ---------------------------------------------------------------------------------------------
// Summary: one table per pp; each figure is the median over rounds of that round's figure.

struct Row {
  std::string schedule;
  int pp = 0, v = 0, m = 0, num_stages = 0;
  std::map<int, std::vector<json>> rounds;  // round -> its ranks' documents
};

// The figures of one round of one schedule. The bubble is measured as simulate_schedule() defines it:
// per step, the makespan is the longest schedule of any rank (the ranks start together after the
// previous step's collectives), and each rank's bubble is the share of it that rank did not compute.
// (A rank's own schedule ends once its sends are received: the last stage then waits out the drain in
// the step's all-reduce, outside its runner's step_seconds.)
struct Figures {
  double bubble = 0;        // 1 - busy / makespan, mean over ranks
  double busiest = 0;       // that of the rank computing the most (the pipeline's pace)
  double imbalance = 0;     // 1 - busy / busiest rank's busy, mean over ranks: idle due to unequal stages
  double step = 0;          // the whole train_step, mean over ranks
  double step_vs_ref = 0;   // step / 1F1B's step in the same round
  double step_vs_ref_lo = 0, step_vs_ref_hi = 0;  // over rounds (in the median over rounds)
  double makespan = 0;      // the schedule part of the step
  double activations = 0;   // forward-phase bytes alive at the step's peak, max over ranks
  double peak = 0;          // peak above the step's start, max over ranks
  double sim_measured = 0;  // simulate_schedule() bubble with this round's per-op costs
  double sim_step = 0;      // and its step time
  std::map<char, double> cost;        // seconds per action, mean over ranks
  std::map<int, double> rank_bubble;  // rank -> 1 - busy / makespan
};

// The textbook bubble where one exists: (p-1)/(m+p-1) for one stage per rank, (p-1)/(v m+p-1) for the
// looped (interleaved) 1F1B; negative where there is none (zero-bubble schedules).
double textbook_bubble(const Row& r) {
  std::string n = r.schedule;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  if (n == "gpipe" || n == "1f1b" || n == "interleaved1f1b")
    return double(r.pp - 1) / (double(r.v) * r.m + r.pp - 1);
  return -1;
}

Figures round_figures(const Row& r, const std::vector<json>& ranks) {
  Figures g;
  const size_t steps = ranks.front()["steps"].size();
  std::vector<double> makespan(steps, 0.0);
  for (const auto& d : ranks) {
    TITAN_USER_CHECK(d["steps"].size() == steps, r.schedule, ": the ranks measured different numbers of steps");
    for (size_t i = 0; i < steps; ++i)
      makespan[i] = std::max(makespan[i], d["steps"][i]["schedule_seconds"].get<double>());
  }
  g.makespan = median(makespan);
  std::map<char, double> cost_sum;
  std::map<char, int> cost_n;
  const double n = static_cast<double>(ranks.size());
  std::map<int, double> busy;  // rank -> median busy seconds
  for (const auto& d : ranks) {
    const int rank = d["rank"].get<int>();
    std::vector<double> b;
    for (size_t i = 0; i < steps; ++i) b.push_back(1 - d["steps"][i]["busy_seconds"].get<double>() / makespan[i]);
    g.rank_bubble[rank] = median(b);
    g.bubble += g.rank_bubble[rank] / n;
    const json& med = d["median"];
    busy[rank] = med["busy_seconds"].get<double>();
    g.step += med["train_step_seconds"].get<double>() / n;
    g.activations = std::max(g.activations, med["forward_bytes_at_peak"].get<double>());
    g.peak = std::max(g.peak, med["peak_above_start_bytes"].get<double>());
    for (const auto& [op, c] : med["op_seconds_per_action"].items()) {
      cost_sum[op[0]] += c.get<double>();
      cost_n[op[0]] += 1;
    }
  }
  const auto busiest = std::max_element(busy.begin(), busy.end(), [](const auto& x, const auto& y) { return x.second < y.second; });
  g.busiest = g.rank_bubble[busiest->first];
  for (const auto& [rank, b] : busy) g.imbalance += (1 - b / busiest->second) / n;
  for (const auto& [op, c] : cost_sum) g.cost[op] = c / cost_n[op];
  // Every stage gets the same per-op costs (the simulation's model): the mean over ranks.
  dist::ActionCosts costs;
  if (g.cost.count('F')) costs.forward = g.cost['F'];
  if (g.cost.count('B')) costs.backward = g.cost['B'];
  if (g.cost.count('I')) costs.backward_input = g.cost['I'];
  if (g.cost.count('W')) costs.backward_weight = g.cost['W'];
  const dist::ScheduleTiming sim =
      dist::simulate_schedule(dist::schedule_by_name(r.schedule, r.pp, r.v, r.m), r.num_stages, costs);
  g.sim_measured = sim.bubble_fraction();
  g.sim_step = sim.step_time;
  return g;
}

// Field by field, the median over rounds.
Figures median_figures(const std::vector<Figures>& rounds) {
  auto med = [&](auto get) {
    std::vector<double> v;
    for (const auto& f : rounds) v.push_back(get(f));
    return median(v);
  };
  Figures g;
  g.bubble = med([](const Figures& f) { return f.bubble; });
  g.busiest = med([](const Figures& f) { return f.busiest; });
  g.imbalance = med([](const Figures& f) { return f.imbalance; });
  g.step = med([](const Figures& f) { return f.step; });
  g.step_vs_ref = med([](const Figures& f) { return f.step_vs_ref; });
  g.step_vs_ref_lo = g.step_vs_ref_hi = g.step_vs_ref;
  for (const auto& f : rounds) {
    g.step_vs_ref_lo = std::min(g.step_vs_ref_lo, f.step_vs_ref);
    g.step_vs_ref_hi = std::max(g.step_vs_ref_hi, f.step_vs_ref);
  }
  g.makespan = med([](const Figures& f) { return f.makespan; });
  g.activations = med([](const Figures& f) { return f.activations; });
  g.peak = med([](const Figures& f) { return f.peak; });
  g.sim_measured = med([](const Figures& f) { return f.sim_measured; });
  g.sim_step = med([](const Figures& f) { return f.sim_step; });
  for (const auto& [op, c] : rounds.front().cost)
    g.cost[op] = med([op = op](const Figures& f) { return f.cost.count(op) ? f.cost.at(op) : 0.0; });
  for (const auto& [rk, b] : rounds.front().rank_bubble)
    g.rank_bubble[rk] = med([rk = rk](const Figures& f) { return f.rank_bubble.count(rk) ? f.rank_bubble.at(rk) : 0.0; });
  return g;
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

int schedule_rank(const std::string& name) {  // table order
  const char* known[] = {"GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"};
  for (int i = 0; i < 5; ++i)
    if (name == known[i]) return i;
  return 5;
}

int run_summary(const std::vector<std::string>& files) {
  std::map<int, std::vector<Row>> by_pp;
  for (const auto& path : files) {
    std::ifstream f(path);
    TITAN_USER_CHECK(f.good(), "cannot read ", path);
    const json doc = json::parse(f);
    auto& rows = by_pp[doc["pp"].get<int>()];
    auto it = std::find_if(rows.begin(), rows.end(), [&](const Row& r) { return r.schedule == doc["schedule"]; });
    if (it == rows.end()) {
      rows.push_back(Row{doc["schedule"].get<std::string>(), doc["pp"].get<int>(), doc["stages_per_rank"].get<int>(),
                         doc["microbatches"].get<int>(), doc["num_stages"].get<int>(), {}});
      it = rows.end() - 1;
    }
    it->rounds[doc.value("round", 1)].push_back(doc);
  }
  for (auto& [pp, rows] : by_pp) {
    std::stable_sort(rows.begin(), rows.end(),
                     [](const Row& a, const Row& b) { return schedule_rank(a.schedule) < schedule_rank(b.schedule); });
    // Per row, per round; the step ratio against 1F1B is taken within each round (the machine's load
    // changes between rounds more than between neighbouring runs).
    std::vector<std::map<int, Figures>> per_round(rows.size());
    for (size_t i = 0; i < rows.size(); ++i)
      for (const auto& [round, ranks] : rows[i].rounds) {
        TITAN_USER_CHECK(static_cast<int>(ranks.size()) == rows[i].pp, rows[i].schedule, " round ", round, " has ",
                         ranks.size(), " rank files, not ", rows[i].pp);
        per_round[i][round] = round_figures(rows[i], ranks);
      }
    const auto ref = std::find_if(rows.begin(), rows.end(), [](const Row& r) { return r.schedule == "1F1B"; });
    std::vector<Figures> figs;
    for (size_t i = 0; i < rows.size(); ++i) {
      std::vector<Figures> rounds;
      for (auto& [round, f] : per_round[i]) {
        if (ref != rows.end() && per_round[ref - rows.begin()].count(round))
          f.step_vs_ref = f.step / per_round[ref - rows.begin()][round].step;
        rounds.push_back(f);
      }
      figs.push_back(median_figures(rounds));
    }
    const auto gpipe = std::find_if(rows.begin(), rows.end(), [](const Row& r) { return r.schedule == "GPipe"; });
    const Figures* ref_mem = gpipe != rows.end() ? &figs[gpipe - rows.begin()] : nullptr;
    std::printf("\npp = %d, %d microbatches, %zu round(s)\n\n", pp, rows.front().m, rows.front().rounds.size());
    std::printf(
        "| schedule | stages per rank | measured bubble | busiest rank's bubble | idle from unequal stages | "
        "textbook bubble | simulated, unit costs | simulated, measured costs | median step | step vs 1F1B (rounds' range) | "
        "activations at peak (max over ranks) | vs GPipe |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      const Figures& g = figs[i];
      const double tb = textbook_bubble(r);
      const double sim_unit =
          dist::simulate_schedule(dist::schedule_by_name(r.schedule, r.pp, r.v, r.m), r.num_stages).bubble_fraction();
      std::printf("| %s | %d | %s | %s | %s | %s | %s | %s | %s s | %s | %s MiB | %s |\n", r.schedule.c_str(), r.v,
                  fmt("%.3f", g.bubble).c_str(), fmt("%.3f", g.busiest).c_str(), fmt("%.3f", g.imbalance).c_str(),
                  tb < 0 ? "none" : fmt("%.3f", tb).c_str(), fmt("%.3f", sim_unit).c_str(),
                  fmt("%.3f", g.sim_measured).c_str(), fmt("%.3f", g.step).c_str(),
                  ref != rows.end() ? (fmt("%.2f", g.step_vs_ref) + " (" + fmt("%.2f", g.step_vs_ref_lo) + "-" +
                                       fmt("%.2f", g.step_vs_ref_hi) + ")").c_str()
                                    : "-",
                  fmt("%.1f", g.activations / 1048576).c_str(),
                  ref_mem ? fmt("%.2f", g.activations / ref_mem->activations).c_str() : "-");
    }
    std::printf(
        "\n| schedule | bubble per rank | F | B | I | W | schedule part of the step | simulated step, measured costs "
        "| peak above the step's start (max over ranks) |\n|---|---|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < rows.size(); ++i) {
      const Figures& g = figs[i];
      std::string per_rank;
      for (const auto& [rk, b] : g.rank_bubble) per_rank += (per_rank.empty() ? "" : " / ") + fmt("%.2f", b);
      auto ms = [&](char op) { return g.cost.count(op) ? fmt("%.1f ms", g.cost.at(op) * 1e3) : std::string("-"); };
      std::printf("| %s | %s | %s | %s | %s | %s | %s s | %s s | %s MiB |\n", rows[i].schedule.c_str(), per_rank.c_str(),
                  ms('F').c_str(), ms('B').c_str(), ms('I').c_str(), ms('W').c_str(),
                  fmt("%.3f", g.makespan).c_str(), fmt("%.3f", g.sim_step).c_str(),
                  fmt("%.1f", g.peak / 1048576).c_str());
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (!args.empty() && args.front() == "--summarize") {
      TITAN_USER_CHECK(args.size() > 1, "--summarize needs the ranks' JSON files");
      return run_summary(std::vector<std::string>(args.begin() + 1, args.end()));
    }
    return run_worker(args);
  } catch (const UserError& e) {
    std::fprintf(stderr, "titan_pipeline_bench: error: %s\n", e.what());
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "titan_pipeline_bench: error from LibTorch: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "titan_pipeline_bench: error: %s\n", e.what());
    return 1;
  }
}
