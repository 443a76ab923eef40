// `titan report`: reading metrics.jsonl and config.toml, the --check comparison, the command line.
// The page itself is rendered by report_html.cpp.
#include "titan/tools/report.h"

#include "titan/common/error.h"
#include "titan/config/field.h"
#include "titan/config/job_config.h"

#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

namespace titan::report {
namespace fs = std::filesystem;
namespace {

using nlohmann::json;

// ---------------------------------------------------------------------------------------------
// metrics.jsonl

// The kinds whose lines are records of a step; other kinds but "start" are ignored.
bool is_step_kind(const std::string& kind) { return kind == "train" || kind == "validation"; }

// A field's value: a number, or a non-finite float written as a string. nullopt: null, or a type
// that is not a number (an error for a field the page reads, ignored for any other).
std::optional<double> number_of(const json& v, bool* wrong_type) {
  *wrong_type = false;
  if (v.is_number()) return v.get<double>();
  if (v.is_null()) return std::nullopt;
  if (v.is_string()) {
    const auto& s = v.get_ref<const std::string&>();
    if (s == "nan") return std::nan("");
    if (s == "inf") return HUGE_VAL;
    if (s == "-inf") return -HUGE_VAL;
  }
  *wrong_type = true;
  return std::nullopt;
}

// Fields whose values the page or the check reads: they must be numbers, null or non-finite strings.
const std::set<std::string>& read_fields() {
  static const std::set<std::string> f = {"time", "loss", "max_loss", "grad_norm", "lr", "tps", "tflops", "mfu_pct",
                                          "memory_gib", "memory_pct", "tokens_seen", "perplexity"};
  return f;
}

std::string excerpt(const std::string& line) { return line.size() <= 80 ? line : line.substr(0, 77) + "..."; }

}  // namespace

Series RunMetrics::series(const std::string& kind, const std::string& field) const {
  Series s;
  auto it = records.find(kind);
  if (it == records.end()) return s;
  for (const auto& [step, record] : it->second) {
    auto f = record.find(field);
    if (f != record.end()) s[step] = f->second;
  }
  return s;
}

RunMetrics parse_metrics(const std::string& text, const std::string& file) {
  RunMetrics run;
  bool after_start = false;  // a start line was read and no step line since (for resumed_at)
  size_t pos = 0;
  int64_t line_no = 0;
  while (pos < text.size()) {
    const size_t end = text.find('\n', pos);
    const bool terminated = end != std::string::npos;
    const std::string line = text.substr(pos, terminated ? end - pos : std::string::npos);
    pos = terminated ? end + 1 : text.size();
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = file + ":" + std::to_string(line_no);
    json j;
    try {
      j = json::parse(line);
    } catch (const json::parse_error& e) {
      if (!terminated) {  // the last line, cut short: a process stopped while writing it
        run.incomplete_last_line = true;
        break;
      }
      throw UserError(where + ": not a JSON line (" + e.what() + "): " + excerpt(line));
    }
    TITAN_USER_CHECK(j.is_object(), where, ": expected a JSON object, got: ", excerpt(line));
    auto kind_it = j.find("kind");
    TITAN_USER_CHECK(kind_it != j.end() && kind_it->is_string(), where, ": the line has no \"kind\" string: ",
                     excerpt(line));
    const std::string kind = kind_it->get<std::string>();
    if (kind != "start" && !is_step_kind(kind)) continue;  // a kind of a newer writer

    std::optional<double> time;
    if (auto t = j.find("time"); t != j.end()) {
      bool wrong = false;
      time = number_of(*t, &wrong);
      TITAN_USER_CHECK(!wrong, where, ": \"time\" must be a number, got ", t->dump());
      if (time && std::isfinite(*time)) {
        run.first_time = std::min(run.first_time.value_or(*time), *time);
        run.last_time = std::max(run.last_time.value_or(*time), *time);
      }
    }
    if (kind == "start") {
      ++run.starts;
      after_start = run.starts > 1;
      // The step the process started from (0: a fresh run, S: resumed after step S). Records of later
      // steps belong to an earlier run in the same folder that went further: a new run replaces them.
      if (auto s = j.find("step"); s != j.end() && s->is_number_integer())
        for (auto& [record_kind, by_step] : run.records) by_step.erase(by_step.upper_bound(s->get<int64_t>()), by_step.end());
      continue;
    }
    auto step_it = j.find("step");
    TITAN_USER_CHECK(step_it != j.end() && step_it->is_number_integer() && step_it->get<int64_t>() >= 0, where,
                     ": a \"", kind, "\" line needs a non-negative integer \"step\": ", excerpt(line));
    const int64_t step = step_it->get<int64_t>();
    Record record;
    for (const auto& [name, value] : j.items()) {
      if (name == "kind" || name == "step") continue;
      bool wrong = false;
      std::optional<double> v = number_of(value, &wrong);
      TITAN_USER_CHECK(!wrong || !read_fields().count(name), where, ": \"", name,
                       "\" must be a number, null, \"nan\", \"inf\" or \"-inf\", got ", value.dump());
      if (v) record[name] = *v;
    }
    run.records[kind][step] = std::move(record);  // a later line of the same step replaces it
    if (after_start && kind == "train") {
      run.resumed_at.push_back(step);
      after_start = false;
    }
  }
  return run;
}

RunMetrics read_metrics(const std::string& dump_folder) {
  std::error_code ec;
  TITAN_USER_CHECK(fs::is_directory(dump_folder, ec), "run folder '", dump_folder,
                   "' does not exist (pass a run's job.dump_folder)");
  const std::string file = (fs::path(dump_folder) / kMetricsFile).string();
  TITAN_USER_CHECK(fs::is_regular_file(file, ec), "'", dump_folder, "' has no ", kMetricsFile,
                   ": is it a run's job.dump_folder, and did the run log a step?");
  std::ifstream in(file, std::ios::binary);
  TITAN_USER_CHECK(in.good(), "cannot read ", file);
  std::stringstream ss;
  ss << in.rdbuf();
  RunMetrics run = parse_metrics(ss.str(), file);
  run.folder = dump_folder;
  return run;
}

// ---------------------------------------------------------------------------------------------
// config.toml

namespace {

// Every leaf of a TOML document as section.key -> its TOML literal.
void flatten(const toml::table& table, const std::string& prefix, std::map<std::string, std::string>& out) {
  for (auto&& [k, node] : table) {
    const std::string path = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (const toml::table* t = node.as_table()) {
      flatten(*t, path, out);
      continue;
    }
    if (const auto* d = node.as_floating_point()) {  // shortest form that reads back: 0.0008, not 0.00080000000000000004
      char buf[64];
      auto [end, ec] = std::to_chars(buf, buf + sizeof buf, d->get(), std::chars_format::general);
      out[path] = std::string(buf, end);
      if (out[path].find_first_of(".eEni") == std::string::npos) out[path] += ".0";  // still a float in TOML
      continue;
    }
    std::ostringstream os;
    node.visit([&](const auto& n) { os << n; });
    out[path] = os.str();
  }
}

// The keys in JobConfig's declaration order, then any other key (an older or newer titan's) sorted.
std::vector<std::string> ordered_keys(const std::set<std::string>& keys) {
  JobConfig defaults;
  std::vector<std::string> ordered;
  std::set<std::string> seen;
  for (const auto& f : config::fields_of(defaults))
    if (keys.count(f.path()) && seen.insert(f.path()).second) ordered.push_back(f.path());
  for (const auto& k : keys)
    if (!seen.count(k)) ordered.push_back(k);
  return ordered;
}

constexpr const char* kIgnoredKey = "job.dump_folder";  // differs between runs by construction

}  // namespace

ConfigTable config_table(const std::vector<std::string>& dump_folders) {
  ConfigTable table;
  std::vector<std::optional<std::map<std::string, std::string>>> configs;
  for (const auto& folder : dump_folders) {
    const std::string file = (fs::path(folder) / kConfigFile).string();
    std::error_code ec;
    if (!fs::is_regular_file(file, ec)) {
      table.notes.push_back(folder + " has no " + kConfigFile + ": its settings are not shown");
      configs.emplace_back();
      continue;
    }
    try {
      std::map<std::string, std::string> flat;
      flatten(toml::parse_file(file), "", flat);
      configs.emplace_back(std::move(flat));
    } catch (const toml::parse_error& e) {
      table.notes.push_back(file + " is not valid TOML (" + std::string(e.description()) + "): its settings are not shown");
      configs.emplace_back();
    }
  }
  if (dump_folders.size() == 1) {  // one run: its settings that are not titan's defaults
    table.against_defaults = true;
    if (!configs[0]) return table;
    std::map<std::string, std::string> defaults;
    flatten(toml::parse(to_toml(JobConfig{})), "", defaults);
    configs.insert(configs.begin(), std::move(defaults));
  }
  std::set<std::string> keys;
  for (const auto& c : configs)
    if (c)
      for (const auto& [k, v] : *c) keys.insert(k);
  for (const auto& key : ordered_keys(keys)) {
    if (key == kIgnoredKey) continue;
    std::vector<std::string> row;
    std::set<std::string> distinct;
    for (const auto& c : configs) {
      if (!c) {
        row.emplace_back();
        continue;
      }
      auto it = c->find(key);
      row.push_back(it == c->end() ? std::string() : it->second);
      distinct.insert(row.back());
    }
    if (distinct.size() < 2) continue;
    table.keys.push_back(key);
    table.values.push_back(std::move(row));
  }
  return table;
}

// ---------------------------------------------------------------------------------------------
// --check

namespace {

bool same_value(double a, double b, double rtol, double atol) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= atol + rtol * std::fabs(b);
}

double relative_difference(double a, double b) {
  if (std::isnan(a) && std::isnan(b)) return 0;
  if (!std::isfinite(a) || !std::isfinite(b)) return a == b ? 0 : HUGE_VAL;
  if (b == 0) return a == 0 ? 0 : HUGE_VAL;
  return std::fabs(a - b) / std::fabs(b);
}

std::string num(double v, int digits = 9) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*g", digits, v);
  return buf;
}

std::string step_list(const std::vector<int64_t>& steps) {
  std::string s;
  for (size_t i = 0; i < steps.size() && i < 10; ++i) s += (i ? ", " : "") + std::to_string(steps[i]);
  if (steps.size() > 10) s += ", ...";
  return s;
}

Series check_series(const RunMetrics& run, const std::string& metric) {
  return run.series(metric == "loss" ? "train" : "validation", "loss");
}

}  // namespace

CheckResult check(const RunMetrics& a, const RunMetrics& b, const CheckOptions& options) {
  TITAN_USER_CHECK(options.metric == "loss" || options.metric == "validation_loss", "--metric '", options.metric,
                   "' is not one of loss, validation_loss");
  const Series sa = check_series(a, options.metric), sb = check_series(b, options.metric);
  CheckResult r;
  r.missing_counts = !options.common_steps_only;
  for (const auto& [step, va] : sa) {
    auto it = sb.find(step);
    if (it == sb.end()) {
      r.only_in_a.push_back(step);
      continue;
    }
    const double vb = it->second;
    ++r.common_steps;
    const double rel = relative_difference(va, vb);
    if (r.max_rel_step < 0 || rel > r.max_rel_diff) {
      r.max_rel_diff = rel;
      r.max_rel_step = step;
    }
    if (same_value(va, vb, options.rtol, options.atol)) continue;
    if (++r.differing_steps == 1) {
      r.first_difference = step;
      r.first_a = va;
      r.first_b = vb;
    }
  }
  for (const auto& [step, vb] : sb)
    if (!sa.count(step)) r.only_in_b.push_back(step);
  TITAN_USER_CHECK(r.common_steps > 0, "no step of ", options.metric, " is in both runs: ", a.folder, " has ",
                   sa.size(), " (", sa.empty() ? "none" : std::to_string(sa.begin()->first) + ".." +
                   std::to_string(sa.rbegin()->first), "), ", b.folder, " has ", sb.size(), " (",
                   sb.empty() ? "none" : std::to_string(sb.begin()->first) + ".." + std::to_string(sb.rbegin()->first),
                   ")", options.metric == "validation_loss" && (sa.empty() || sb.empty())
                       ? "; validation_loss needs [validation] enable in both runs" : "");
  return r;
}

std::string format_check(const CheckResult& r, const RunMetrics& a, const RunMetrics& b, const CheckOptions& o) {
  std::ostringstream os;
  const std::string tol = "rtol " + num(o.rtol, 3) + ", atol " + num(o.atol, 3);
  if (r.differing_steps == 0) {
    os << o.metric << ": " << a.folder << " and " << b.folder << " agree at all " << r.common_steps
       << " common steps within " << tol << "; largest relative difference " << num(r.max_rel_diff, 3) << " (step "
       << r.max_rel_step << ")\n";
    if (!r.agree())
      os << o.metric << ": the runs differ in the steps they logged (one stopped early, or they logged at other "
         << "steps); --common-steps-only compares the common steps alone\n";
  } else {
    os << o.metric << ": " << a.folder << " and " << b.folder << " differ at " << r.differing_steps << " of "
       << r.common_steps << " common steps (" << tol << ")\n"
       << "  first differing step: " << *r.first_difference << " (" << num(r.first_a) << " vs " << num(r.first_b)
       << ", relative difference " << num(relative_difference(r.first_a, r.first_b), 3) << ")\n"
       << "  largest relative difference: " << num(r.max_rel_diff, 3) << " (step " << r.max_rel_step << ")\n";
  }
  const char* what = r.missing_counts ? ": " : ", not compared: ";
  if (!r.only_in_a.empty())
    os << "  " << r.only_in_a.size() << " step(s) only in " << a.folder << what << step_list(r.only_in_a) << "\n";
  if (!r.only_in_b.empty())
    os << "  " << r.only_in_b.size() << " step(s) only in " << b.folder << what << step_list(r.only_in_b) << "\n";
  return os.str();
}

// ---------------------------------------------------------------------------------------------
// The command line

std::string report_usage() {
  return "titan report DUMP_FOLDER [DUMP_FOLDER ...] [--output FILE]\n"
         "titan report --check RUN_A RUN_B [--rtol R] [--atol A] [--metric loss|validation_loss]\n\n"
         "Reads each run's metrics.jsonl (written by the trainer's metrics rank) and config.toml.\n\n"
         "Without --check: writes one self-contained HTML page (no network needed) with plots over steps of\n"
         "loss, validation loss, learning rate, gradient norm, tokens/s, MFU and memory. Several folders\n"
         "overlay their runs, one colour each, and a table lists the config keys whose values differ between\n"
         "them (one run: its settings that differ from titan's defaults). A metric that no run recorded\n"
         "(validation off, MFU on CPU) is a one-line note instead of a plot.\n"
         "  --output FILE, -o FILE   where to write the page (default: report.html in the first folder)\n\n"
         "With --check: compares the two runs' curves step by step. A step agrees when\n"
         "|a - b| <= atol + rtol * |b| (b: RUN_B, the reference), or when both are the same non-finite value;\n"
         "a step that only one run logged is a difference too (a run that stopped early does not pass).\n"
         "Prints the first differing step, how many differ and the largest relative difference.\n"
         "  --rtol R                 relative tolerance (default 1e-5: what data-parallel layouts keep from the\n"
         "                           single process in fp32; 0 asks for bit-identical losses)\n"
         "  --atol A                 absolute tolerance (default 0)\n"
         "  --metric M               loss (training, default) or validation_loss\n"
         "  --common-steps-only      compare only the steps both runs logged (e.g. other log_freq)\n\n"
         "Exit status: 0 page written / curves agree; 1 the curves differ; 2 bad usage or unreadable input\n"
         "(a missing folder or file, a malformed line: named as file:line, no common step).\n"
         "See docs/metrics.md, section \"titan report\".\n";
}

namespace {

double parse_tolerance(const std::string& name, const std::string& text) {
  double v = 0;
  size_t used = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::logic_error&) {
    used = 0;
  }
  TITAN_USER_CHECK(used == text.size() && !text.empty() && std::isfinite(v) && v >= 0, name,
                   " takes a non-negative number, got '", text, "'");
  return v;
}

int run(const std::vector<std::string>& args) {
  bool check_mode = false, common_only = false;
  std::optional<std::string> output, rtol, atol, metric;
  std::vector<std::string> folders;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&](std::optional<std::string>& slot, const std::string& name) -> bool {
      if (a == name || (name == "--output" && a == "-o")) {
        TITAN_USER_CHECK(i + 1 < args.size(), a, " needs a value\n", report_usage());
        slot = args[++i];
        return true;
      }
      if (a.rfind(name + "=", 0) == 0) {
        slot = a.substr(name.size() + 1);
        return true;
      }
      return false;
    };
    if (a == "--check") {
      check_mode = true;
    } else if (a == "--common-steps-only") {
      common_only = true;
    } else if (value(output, "--output") || value(rtol, "--rtol") || value(atol, "--atol") ||
               value(metric, "--metric")) {
    } else if (a.size() > 1 && a[0] == '-') {
      throw UserError("unknown option '" + a + "'\n" + report_usage());
    } else {
      folders.push_back(a);
    }
  }
  if (check_mode) {
    TITAN_USER_CHECK(folders.size() == 2, "--check compares two runs: give RUN_A RUN_B (got ", folders.size(),
                     " folder(s))\n", report_usage());
    TITAN_USER_CHECK(!output, "--output writes the page; it does not go with --check");
    CheckOptions o;
    if (rtol) o.rtol = parse_tolerance("--rtol", *rtol);
    if (atol) o.atol = parse_tolerance("--atol", *atol);
    if (metric) o.metric = *metric;
    o.common_steps_only = common_only;
    const RunMetrics a = read_metrics(folders[0]), b = read_metrics(folders[1]);
    const CheckResult r = check(a, b, o);
    std::cout << format_check(r, a, b, o);
    return r.agree() ? kExitOk : kExitDiffer;
  }
  TITAN_USER_CHECK(!rtol && !atol && !metric, "--rtol, --atol and --metric go with --check\n", report_usage());
  TITAN_USER_CHECK(!folders.empty(), "give at least one run folder\n", report_usage());
  std::vector<RunMetrics> runs;
  for (const auto& f : folders) {
    runs.push_back(read_metrics(f));
    if (runs.back().incomplete_last_line)
      std::cerr << "titan report: warning: the last line of " << (fs::path(f) / kMetricsFile).string()
                << " is incomplete (the run stopped while writing it) and was left out\n";
  }
  const std::string html = render_html(runs, config_table(folders));
  const std::string out = output.value_or((fs::path(folders[0]) / "report.html").string());
  {
    std::ofstream f(out, std::ios::binary | std::ios::trunc);
    TITAN_USER_CHECK(f.good(), "cannot write ", out);
    f << html;
    f.close();
    TITAN_USER_CHECK(!f.fail(), "cannot write ", out, " (disk full?)");
  }
  std::vector<std::string> absent;
  for (const auto& p : plots())
    if (!recorded(runs, p)) absent.push_back(p.id);
  std::cout << "wrote " << out << " (" << runs.size() << " run" << (runs.size() == 1 ? "" : "s");
  if (!absent.empty()) {
    std::cout << "; not recorded:";
    for (const auto& a : absent) std::cout << " " << a;
  }
  std::cout << ")\n";
  return kExitOk;
}

}  // namespace

int run_report(const std::vector<std::string>& args) {
  if (args.empty()) {
    std::fputs(report_usage().c_str(), stderr);
    return kExitUsage;
  }
  if (std::find(args.begin(), args.end(), "--help") != args.end() ||
      std::find(args.begin(), args.end(), "-h") != args.end()) {
    std::cout << report_usage();
    return kExitOk;
  }
  try {
    return run(args);
  } catch (const std::exception& e) {  // UserError, and file system errors: all are input errors here
    std::fprintf(stderr, "titan report: error: %s\n", e.what());
    return kExitUsage;
  }
}

}  // namespace titan::report
