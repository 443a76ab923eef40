// `titan report`: reading metrics.jsonl, the page in a real browser, and --check on real runs.
//
// The page test opens the written file in headless Chromium (Debian's package, installed by
// scripts/setup.sh) and reads the DOM after the page's script ran: no script error, one plot per
// metric with one line per run, the legend naming each folder, the config difference. The check
// tests train the debug model for a few steps through the real binaries: FSDP over 2 processes must
// agree with one process within the default tolerance (rtol 1e-5, the parity every data-parallel
// layout keeps in fp32: tests/unit/distributed/launch_train_test.cpp), and a run with half the
// learning rate must differ from step 2 on (step 1's loss is computed before any update).
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/config/job_config.h"
#include "titan/tools/report.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <unistd.h>

namespace titan {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using report::RunMetrics;

const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";

void write_file(const std::string& path, const std::string& text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A run folder with hand-written metrics (every metric, steps 1..n) and config.toml.
std::string make_run(const test::TempDir& dir, const std::string& name, double lr, int steps, bool validation,
                     bool mfu) {
  const std::string folder = dir / name;
  std::ostringstream m;
  m << "{\"kind\":\"start\",\"time\":1763760000.5,\"restart\":0}\n";
  for (int s = 1; s <= steps; ++s) {
    m << "{\"kind\":\"train\",\"step\":" << s << ",\"time\":" << 1763760001 + s << ",\"loss\":" << 8.0 - lr * 100 * s
      << ",\"max_loss\":8.5,\"grad_norm\":" << 1.0 + 0.1 * s << ",\"lr\":" << lr << ",\"tps\":" << 1700 + 10 * s
      << ",\"tflops\":0.1,\"mfu_pct\":" << (mfu ? std::to_string(20 + s) : "null") << ",\"memory_gib\":" << 3.4
      << ",\"memory_pct\":14.5,\"tokens_seen\":" << 256 * s << "}\n";
    if (validation && s % 2 == 0)
      m << "{\"kind\":\"validation\",\"step\":" << s << ",\"time\":1763760100,\"loss\":" << 8.2 - lr * 100 * s
        << ",\"perplexity\":3000.0,\"memory_gib\":3.4,\"memory_pct\":14.5}\n";
  }
  write_file(folder + "/" + report::kMetricsFile, m.str());
  JobConfig cfg;
  cfg.optimizer.lr = lr;
  cfg.training.steps = steps;
  cfg.job.dump_folder = folder;
  write_file(folder + "/" + report::kConfigFile, to_toml(cfg));
  return folder;
}

test::ProcessResult titan(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {kTitan};
  argv.insert(argv.end(), args.begin(), args.end());
  return test::run_process(argv, {{"OMP_NUM_THREADS", "1"}}, 300s);
}

// ---------------------------------------------------------------------------------------------
// The page in headless Chromium

std::string find_on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  std::string d;
  while (std::getline(dirs, d, ':'))
    if (!d.empty() && ::access((d + "/" + program).c_str(), X_OK) == 0) return d + "/" + program;
  return "";
}

// The DOM of `html_file` after its scripts ran, as headless Chromium serializes it.
std::string browser_dom(const std::string& html_file) {
  const std::string chromium = find_on_path("chromium");
  if (chromium.empty()) {
    ADD_FAILURE() << "chromium is not on PATH: run scripts/setup.sh, which installs Debian's chromium package "
                     "(the headless browser this test opens the report in)";
    return "";
  }
  test::TempDir profile;
  const std::string dom = profile / "dom.html";
  const std::string command = "exec '" + chromium + "' --headless --no-sandbox --disable-gpu --disable-dev-shm-usage "
                              "--no-first-run --user-data-dir='" + profile.path() + "/profile' --dump-dom 'file://" +
                              fs::absolute(html_file).string() + "' > '" + dom + "' 2>/dev/null";
  auto r = test::run_process({"/bin/sh", "-c", command}, {}, 90s);
  EXPECT_FALSE(r.timed_out) << "chromium did not finish within 90 s";
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return read_file(dom);
}

// The element that starts with the first tag matching `open_tag` (a regex), up to its `close`.
std::string element(const std::string& dom, const std::string& open_tag, const std::string& close) {
  std::smatch m;
  if (!std::regex_search(dom, m, std::regex(open_tag))) return "";
  const size_t begin = m.position(0), end = dom.find(close, begin);
  return end == std::string::npos ? "" : dom.substr(begin, end + close.size() - begin);
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

std::string attribute(const std::string& dom, const std::string& name) {
  std::smatch m;
  return std::regex_search(dom, m, std::regex(name + "=\"([^\"]*)\"")) ? m[1].str() : "<absent>";
}

// After the page's own script: hover every plot once, so the readout's code runs too.
const char* kHoverScript =
    "<script>document.querySelectorAll('svg.plot').forEach(function (s) { var r = s.getBoundingClientRect();"
    " s.dispatchEvent(new MouseEvent('mousemove', {clientX: r.left + r.width / 2, clientY: r.top + r.height / 2})); });"
    "</script></body>";

TEST(ReportPage, TwoRunsOpenInChromiumWithOnePlotPerMetricAndALinePerRun) {
  test::TempDir dir;
  const std::string a = make_run(dir, "run_lr8", 8e-4, 20, true, true);
  const std::string b = make_run(dir, "run_lr4", 4e-4, 12, true, true);
  auto r = titan({"report", a, b, "--output", dir / "page.html"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::string html = read_file(dir / "page.html");
  EXPECT_EQ(count(html, "http"), count(html, "http://www.w3.org/2000/svg")) << "the page must not load anything";
  EXPECT_EQ(count(html, " src="), 0u);
  EXPECT_EQ(html.find("<svg"), std::string::npos) << "the plots must be drawn by the script, not written";
  html.replace(html.rfind("</body>"), 7, kHoverScript);
  write_file(dir / "hovered.html", html);

  const std::string dom = browser_dom(dir / "hovered.html");
  ASSERT_FALSE(dom.empty());
  EXPECT_EQ(attribute(dom, "data-errors"), "") << "script errors in the page";
  EXPECT_EQ(attribute(dom, "data-rendered"), "7");
  for (const auto& plot : report::plots()) {
    const std::string svg = element(dom, "<svg[^>]*data-metric=\"" + plot.id + "\"[^>]*>", "</svg>");
    ASSERT_FALSE(svg.empty()) << "no plot of " << plot.id;
    EXPECT_NE(svg.find("class=\"plot\""), std::string::npos) << svg.substr(0, 200);
    EXPECT_EQ(count(svg, "class=\"series\""), 2u) << plot.id;
    EXPECT_NE(svg.find("data-run=\"0\""), std::string::npos) << plot.id;
    EXPECT_NE(svg.find("data-run=\"1\""), std::string::npos) << plot.id;
    EXPECT_GE(count(svg, "<text"), 6u) << plot.id << ": axes without tick labels";
    const std::string legend = element(dom, "<div[^>]*class=\"legend\"[^>]*data-metric=\"" + plot.id + "\"", "</div>");
    EXPECT_NE(legend.find(a), std::string::npos) << plot.id << " legend: " << legend;
    EXPECT_NE(legend.find(b), std::string::npos) << plot.id << " legend: " << legend;
  }
  EXPECT_EQ(count(dom, "class=\"not-recorded\""), 0u);
  EXPECT_GE(count(dom, "<div class=\"readout\">step "), 7u) << "the hover readout did not fill in";
  const std::string config = element(dom, "<table class=\"config\">", "</table>");
  EXPECT_NE(config.find("optimizer.lr"), std::string::npos) << config;
  EXPECT_NE(config.find("0.0008"), std::string::npos) << config;
  EXPECT_NE(config.find("0.0004"), std::string::npos) << config;
  EXPECT_NE(config.find("training.steps"), std::string::npos) << config;
  EXPECT_EQ(config.find("job.dump_folder"), std::string::npos) << "differs by construction: left out";
  EXPECT_EQ(config.find("optimizer.name"), std::string::npos) << "equal keys are left out";
}

TEST(ReportPage, AMetricNoRunRecordedIsANoteInsteadOfAPlot) {
  test::TempDir dir;
  const std::string a = make_run(dir, "cpu_run", 8e-4, 5, /*validation=*/false, /*mfu=*/false);
  auto r = titan({"report", a});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("not recorded: validation_loss mfu"), std::string::npos) << r.output;
  const std::string dom = browser_dom(a + "/report.html");  // the default output
  ASSERT_FALSE(dom.empty());
  EXPECT_EQ(attribute(dom, "data-errors"), "");
  EXPECT_EQ(attribute(dom, "data-rendered"), "5");
  for (const std::string id : {"validation_loss", "mfu"}) {
    EXPECT_EQ(element(dom, "<svg[^>]*data-metric=\"" + id + "\"", "</svg>"), "") << id;
    const std::string note = element(dom, "<p class=\"not-recorded\" data-metric=\"" + id + "\">", "</p>");
    EXPECT_NE(note.find("not recorded"), std::string::npos) << id << ": " << note;
  }
  EXPECT_NE(element(dom, "<svg[^>]*data-metric=\"loss\"", "</svg>").find("class=\"series\""), std::string::npos);
  // One run: its settings other than the defaults.
  const std::string config = element(dom, "<table class=\"config\">", "</table>");
  EXPECT_NE(config.find("training.steps"), std::string::npos) << config;
  EXPECT_EQ(config.find("optimizer.lr"), std::string::npos) << "8e-4 is the default";
}

// Values equal but for the last bit of a double (a float64 validation loss of two layouts) make an
// axis of zero width at a magnitude where adding 1 to a tick index no longer changes it: the axis
// must still draw (bounded ticks), not loop or drop the plot.
TEST(ReportPage, ValuesOneUlpApartStillDraw) {
  test::TempDir dir;
  const std::string a = make_run(dir, "a", 8e-4, 3, /*validation=*/false, /*mfu=*/true);
  const std::string b = make_run(dir, "b", 8e-4, 3, /*validation=*/false, /*mfu=*/true);
  std::ofstream(a + "/" + report::kMetricsFile, std::ios::app) << "{\"kind\":\"validation\",\"step\":2,\"loss\":7.9851}\n";
  std::ofstream(b + "/" + report::kMetricsFile, std::ios::app)
      << "{\"kind\":\"validation\",\"step\":2,\"loss\":7.985100000000001}\n";
  auto r = titan({"report", a, b});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto start = std::chrono::steady_clock::now();
  const std::string dom = browser_dom(a + "/report.html");
  ASSERT_FALSE(dom.empty());
  EXPECT_EQ(attribute(dom, "data-errors"), "");
  EXPECT_EQ(attribute(dom, "data-rendered"), "7");
  EXPECT_NE(element(dom, "<svg[^>]*data-metric=\"validation_loss\"", "</svg>").find("class=\"series\""), std::string::npos);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
}

// ---------------------------------------------------------------------------------------------
// metrics.jsonl

TEST(ReportMetrics, AResumedRunsLaterLinesSupersedeEarlierOnesOfTheSameStep) {
  const RunMetrics r = report::parse_metrics(
      "{\"kind\":\"start\",\"time\":100,\"restart\":0}\n"
      "{\"kind\":\"train\",\"step\":1,\"time\":101,\"loss\":8.0,\"mfu_pct\":20}\n"
      "{\"kind\":\"train\",\"step\":2,\"time\":102,\"loss\":7.5,\"mfu_pct\":21}\n"
      "{\"kind\":\"start\",\"time\":200,\"restart\":1}\n"
      "{\"kind\":\"train\",\"step\":2,\"time\":201,\"loss\":7.6,\"mfu_pct\":null}\n"
      "{\"kind\":\"train\",\"step\":3,\"time\":202,\"loss\":7.1}\n",
      "m.jsonl");
  EXPECT_EQ(r.series("train", "loss"), (report::Series{{1, 8.0}, {2, 7.6}, {3, 7.1}}));
  EXPECT_EQ(r.series("train", "mfu_pct"), (report::Series{{1, 20}})) << "the whole record is replaced; null is absent";
  EXPECT_EQ(r.starts, 2);
  EXPECT_EQ(r.resumed_at, std::vector<int64_t>{2});
  EXPECT_EQ(*r.first_time, 100);
  EXPECT_EQ(*r.last_time, 202);
}

// A start line names the step the process began after: a fresh run (step 0) in a folder that an
// earlier, longer run used replaces all of that run's steps; a resume after step 4 keeps steps 1-4.
TEST(ReportMetrics, AFreshRunInAReusedFolderReplacesTheOldRunsLaterSteps) {
  const std::string old_run =
      "{\"kind\":\"start\",\"time\":100,\"restart\":0,\"step\":0}\n"
      "{\"kind\":\"train\",\"step\":1,\"loss\":8.0}\n{\"kind\":\"train\",\"step\":2,\"loss\":7.5}\n"
      "{\"kind\":\"validation\",\"step\":2,\"loss\":7.4}\n"
      "{\"kind\":\"train\",\"step\":3,\"loss\":7.0}\n{\"kind\":\"train\",\"step\":4,\"loss\":6.5}\n"
      "{\"kind\":\"train\",\"step\":5,\"loss\":6.0}\n{\"kind\":\"train\",\"step\":6,\"loss\":5.5}\n";
  const RunMetrics fresh = report::parse_metrics(
      old_run + "{\"kind\":\"start\",\"time\":200,\"restart\":0,\"step\":0}\n"
                "{\"kind\":\"train\",\"step\":1,\"loss\":8.1}\n{\"kind\":\"train\",\"step\":2,\"loss\":7.9}\n",
      "m.jsonl");
  EXPECT_EQ(fresh.series("train", "loss"), (report::Series{{1, 8.1}, {2, 7.9}}));
  EXPECT_TRUE(fresh.series("validation", "loss").empty());
  const RunMetrics resumed = report::parse_metrics(
      old_run + "{\"kind\":\"start\",\"time\":200,\"restart\":1,\"step\":4}\n"
                "{\"kind\":\"train\",\"step\":5,\"loss\":6.1}\n",
      "m.jsonl");
  EXPECT_EQ(resumed.series("train", "loss"), (report::Series{{1, 8.0}, {2, 7.5}, {3, 7.0}, {4, 6.5}, {5, 6.1}}));
  EXPECT_EQ(resumed.series("validation", "loss"), (report::Series{{2, 7.4}}));
}

TEST(ReportMetrics, UnknownKindsAndFieldsAreIgnoredAndNonFiniteStringsRead) {
  const RunMetrics r = report::parse_metrics(
      "{\"kind\":\"profile\",\"step\":\"x\",\"whatever\":[1]}\n\n"
      "{\"kind\":\"train\",\"step\":1,\"loss\":\"nan\",\"grad_norm\":\"inf\",\"lr\":\"-inf\",\"note\":\"hi\",\"extra\":{}}\n",
      "m.jsonl");
  EXPECT_EQ(r.records.size(), 1u);
  EXPECT_TRUE(std::isnan(r.series("train", "loss").at(1)));
  EXPECT_EQ(r.series("train", "grad_norm").at(1), HUGE_VAL);
  EXPECT_EQ(r.series("train", "lr").at(1), -HUGE_VAL);
  EXPECT_TRUE(r.series("train", "note").empty());
}

void expect_error(const std::string& text, const std::string& message) {
  try {
    report::parse_metrics(text, "run/metrics.jsonl");
    ADD_FAILURE() << "no error for: " << text;
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
  }
}

TEST(ReportMetrics, AMalformedLineIsAnErrorNamingFileAndLine) {
  const std::string ok = "{\"kind\":\"train\",\"step\":1,\"loss\":8}\n";
  expect_error(ok + "{\"kind\":\"train\",\"step\":2,\"loss\":\n" + ok, "run/metrics.jsonl:2: not a JSON line");
  expect_error(ok + ok + "[1,2]\n", "run/metrics.jsonl:3: expected a JSON object");
  expect_error(ok + "{\"step\":2}\n", "run/metrics.jsonl:2: the line has no \"kind\"");
  expect_error(ok + "{\"kind\":\"train\",\"loss\":8}\n", "run/metrics.jsonl:2: a \"train\" line needs a non-negative integer \"step\"");
  expect_error(ok + "{\"kind\":\"validation\",\"step\":2.5}\n", "run/metrics.jsonl:2:");
  expect_error(ok + "{\"kind\":\"train\",\"step\":2,\"loss\":\"high\"}\n", "run/metrics.jsonl:2: \"loss\" must be a number");
}

TEST(ReportMetrics, AnUnterminatedUnreadableLastLineIsLeftOutAndFlagged) {
  const RunMetrics r = report::parse_metrics("{\"kind\":\"train\",\"step\":1,\"loss\":8}\n{\"kind\":\"train\",\"st", "m");
  EXPECT_TRUE(r.incomplete_last_line);
  EXPECT_EQ(r.series("train", "loss").size(), 1u);
}

// ---------------------------------------------------------------------------------------------
// --check, in process

RunMetrics losses(const std::string& name, const std::map<int64_t, double>& values) {
  std::string text;
  for (const auto& [step, v] : values) {
    std::ostringstream os;
    os.precision(17);
    os << "{\"kind\":\"train\",\"step\":" << step << ",\"loss\":";
    if (std::isnan(v)) os << "\"nan\"";
    else if (std::isinf(v)) os << (v > 0 ? "\"inf\"" : "\"-inf\"");
    else os << v;
    text += os.str() + "}\n";
  }
  RunMetrics r = report::parse_metrics(text, name);
  r.folder = name;
  return r;
}

TEST(ReportCheck, ToleranceIsAtolPlusRtolTimesTheReference) {
  const report::CheckOptions o;  // rtol 1e-5, atol 0
  EXPECT_TRUE(report::check(losses("a", {{1, 8.0 * (1 + 0.9e-5)}}), losses("b", {{1, 8.0}}), o).agree());
  EXPECT_FALSE(report::check(losses("a", {{1, 8.0 * (1 + 1.1e-5)}}), losses("b", {{1, 8.0}}), o).agree());
  report::CheckOptions exact{.metric = "loss", .rtol = 0, .atol = 0};
  EXPECT_FALSE(report::check(losses("a", {{1, std::nextafter(8.0, 9.0)}}), losses("b", {{1, 8.0}}), exact).agree());
  report::CheckOptions abs{.metric = "loss", .rtol = 0, .atol = 0.01};
  EXPECT_TRUE(report::check(losses("a", {{1, 0.005}}), losses("b", {{1, 0}}), abs).agree());
}

TEST(ReportCheck, NonFiniteValuesAgreeOnlyWithTheSameNonFiniteValue) {
  const double nan = std::nan(""), inf = HUGE_VAL;
  const auto r = report::check(losses("a", {{1, nan}, {2, inf}, {3, nan}, {4, inf}, {5, nan}, {6, 1.0}}),
                               losses("b", {{1, nan}, {2, inf}, {3, inf}, {4, -inf}, {5, 1.0}, {6, nan}}), {});
  EXPECT_EQ(r.common_steps, 6);
  EXPECT_EQ(r.differing_steps, 4);
  EXPECT_EQ(*r.first_difference, 3);
  EXPECT_EQ(r.max_rel_diff, HUGE_VAL);
}

TEST(ReportCheck, StepsOfOneRunOnlyAreADifferenceUnlessCommonStepsOnly) {
  const auto a = losses("runA", {{1, 8}, {2, 7.5}, {3, 7}, {4, 6.5}});
  const auto b = losses("runB", {{3, 7}, {4, 6.5}, {5, 6}, {6, 5.5}, {7, 5}});
  // A run that stopped early (or logged other steps) does not pass.
  const auto r = report::check(a, b, {});
  EXPECT_FALSE(r.agree());
  EXPECT_EQ(r.differing_steps, 0);
  EXPECT_EQ(r.common_steps, 2);
  EXPECT_EQ(r.only_in_a, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(r.only_in_b, (std::vector<int64_t>{5, 6, 7}));
  std::string text = report::format_check(r, a, b, {});
  EXPECT_NE(text.find("agree at all 2 common steps"), std::string::npos) << text;
  EXPECT_NE(text.find("the runs differ in the steps they logged"), std::string::npos) << text;
  EXPECT_NE(text.find("2 step(s) only in runA: 1, 2"), std::string::npos) << text;
  EXPECT_NE(text.find("3 step(s) only in runB: 5, 6, 7"), std::string::npos) << text;
  // --common-steps-only compares the common steps alone.
  report::CheckOptions common;
  common.common_steps_only = true;
  const auto c = report::check(a, b, common);
  EXPECT_TRUE(c.agree());
  text = report::format_check(c, a, b, common);
  EXPECT_NE(text.find("2 step(s) only in runA, not compared: 1, 2"), std::string::npos) << text;
  EXPECT_EQ(text.find("the runs differ"), std::string::npos) << text;
  EXPECT_THROW(report::check(losses("a", {{1, 8}}), losses("b", {{2, 8}}), {}), UserError);
}

// ---------------------------------------------------------------------------------------------
// The command line: exit statuses and messages

// run_report in this process (the binary's main only forwards to it): exit status and what it printed.
std::pair<int, std::string> report_in_process(const std::vector<std::string>& args) {
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  const int code = report::run_report(args);
  std::string out = testing::internal::GetCapturedStdout();
  return {code, out + testing::internal::GetCapturedStderr()};
}

TEST(ReportCommand, BadInputIsExitTwoWithAClearMessage) {
  test::TempDir dir;
  const std::string a = make_run(dir, "a", 8e-4, 3, false, false);
  auto r = titan({"report", "--check", a, dir / "missing"});  // through the binary once
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("titan report: error: run folder '" + dir / "missing" + "' does not exist"), std::string::npos)
      << r.output;
  fs::create_directories(dir / "empty");
  auto [code, out] = report_in_process({a, dir / "empty"});
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("has no metrics.jsonl"), std::string::npos) << out;
  write_file(dir / "bad/metrics.jsonl", "{\"kind\":\"start\"}\n{\"kind\":\"train\",\"step\":1,\"loss\":8}\n{oops}\n");
  std::tie(code, out) = report_in_process({"--check", a, dir / "bad"});
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find(dir / "bad/metrics.jsonl:3: not a JSON line"), std::string::npos) << out;
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--check", a}, {"--check", a, a, "--rtol", "-1"}, {"--check", a, a, "--atol", "x"},
        {"--check", a, a, "--metric", "perplexity"}, {a, "--atol", "1"}, {a, "--frobnicate"}, {"--check", a, a, "-o", "f"}}) {
    std::tie(code, out) = report_in_process(args);
    EXPECT_EQ(code, 2) << args.back() << ": " << out;
    EXPECT_EQ(out.rfind("titan report: error: ", 0), 0u) << out;
  }
  std::tie(code, out) = report_in_process({"--check", a, a, "--metric", "validation_loss"});
  EXPECT_EQ(code, 2) << "no common step";
  EXPECT_NE(out.find("no step of validation_loss is in both runs"), std::string::npos) << out;
  std::tie(code, out) = report_in_process({});
  EXPECT_EQ(code, 2);
  EXPECT_NE(out.find("titan report --check RUN_A RUN_B"), std::string::npos) << "usage";
}

TEST(ReportCommand, HelpDocumentsBothModesAndTitanListsTheCommand) {
  auto r = titan({"report", "--help"});
  EXPECT_EQ(r.exit_code, 0);
  for (const char* s : {"--output", "--check", "--rtol", "--atol", "--metric", "Exit status"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s;
  r = titan({"--help"});
  EXPECT_NE(r.output.find("  report "), std::string::npos) << r.output;
}

// ---------------------------------------------------------------------------------------------
// --check on real runs of the debug model

std::vector<std::string> train_args(const std::string& dump, int local_batch, const std::string& lr = "8e-4") {
  return {"train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder", dump,
          "--training.seq_len", "32", "--training.local_batch_size", std::to_string(local_batch),
          "--training.global_batch_size", "8", "--training.steps", "5", "--lr_scheduler.warmup_steps", "2",
          "--metrics.log_freq", "1", "--optimizer.lr", lr};
}

TEST(ReportRuns, CheckPassesForFsdp2AgainstOneProcessAndFailsForAnotherLearningRate) {
  test::TempDir dir;
  const std::string single = dir / "single", fsdp = dir / "fsdp2", other_lr = dir / "lr4e-4";
  auto r = titan(train_args(single, 8));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::string> launch = {"launch", "--nproc-per-node", "2", "--master-port", "0", "--"};
  auto fsdp_args = train_args(fsdp, 4);
  launch.insert(launch.end(), fsdp_args.begin(), fsdp_args.end());
  r = titan(launch);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = titan(train_args(other_lr, 8, "4e-4"));
  ASSERT_EQ(r.exit_code, 0) << r.output;

  r = titan({"report", "--check", fsdp, single});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("agree at all 5 common steps within rtol 1e-05, atol 0"), std::string::npos) << r.output;

  r = titan({"report", "--check", other_lr, single});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("differ at 4 of 5 common steps"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("first differing step: 2 "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("largest relative difference: "), std::string::npos) << r.output;

  r = titan({"report", single, fsdp, other_lr, "--output", dir / "runs.html"});  // real files render too
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(report::config_table({single, fsdp, other_lr}).keys,
            (std::vector<std::string>{"optimizer.lr", "training.local_batch_size"}));
}

}  // namespace
}  // namespace titan
