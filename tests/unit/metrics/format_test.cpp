// The log line and number formatting against Python's own formatting (the language torchtitan
// prints with; tests/reference/metrics_format_reference.py), and parsing of the line with the kind
// of regular expression torchtitan users apply to its logs.
#include "test_util.h"

#include "titan/components/metrics/format.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <limits>
#include <random>
#include <regex>

namespace titan::metrics {
namespace {

// What users write to pull the figures out of torchtitan's log lines.
const std::regex& log_line_regex() {
  static const std::regex re(
      R"(step:\s*(\d+)\s+loss:\s*([-\d.]+|nan)\s+grad_norm:\s*([-\d.]+|nan)\s+memory:\s*([\d.]+)GiB\(([\d.]+)%\)\s+)"
      R"(tps:\s*([\d,]+)\s+tflops:\s*([\d,.]+)\s+mfu:\s*(?:([\d.]+)%|N/A))");
  return re;
}

std::string strip_ansi(const std::string& s) { return std::regex_replace(s, std::regex("\033\\[[0-9;]*m"), ""); }

std::string remove_commas(std::string s) {
  s.erase(std::remove(s.begin(), s.end(), ','), s.end());
  return s;
}

nlohmann::json run_reference(const nlohmann::json& cases) {
  test::TempDir dir;
  std::ofstream(dir / "in.json") << cases.dump();
  auto result = test::run_process({test::python(), std::string(TITAN_SOURCE_DIR) + "/tests/reference/metrics_format_reference.py",
                                   dir / "in.json", dir / "out.json"});
  EXPECT_EQ(result.exit_code, 0) << result.output;
  std::ifstream in(dir / "out.json");
  return nlohmann::json::parse(in);
}

LogLineFields fields_of(const nlohmann::json& j) {
  LogLineFields f;
  f.step = j["step"];
  f.loss = j["loss"];
  f.grad_norm = j["grad_norm"];
  f.memory_gib = j["memory_gib"];
  f.memory_pct = j["memory_pct"];
  f.tps = j["tps"];
  f.tflops = j["tflops"];
  if (!j["mfu_pct"].is_null()) f.mfu_pct = j["mfu_pct"].get<double>();
  return f;
}

TEST(MetricsFormat, MatchesPython) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> unit(0, 1);
  nlohmann::json cases = {{"ints", nlohmann::json::array()}, {"fixed", nlohmann::json::array()},
                          {"rounds", nlohmann::json::array()}, {"lines", nlohmann::json::array()}};
  for (int64_t n : {int64_t{0}, int64_t{7}, int64_t{999}, int64_t{1000}, int64_t{-1000}, int64_t{1710}, int64_t{123456},
                    int64_t{-1234567}, int64_t{1000000}, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()}) {
    cases["ints"].push_back(n);
  }
  // Ties and near-ties exercise the rounding of the exact binary value (0.125 is exact, 2.675 is not).
  std::vector<double> values = {0.0, -0.0, 0.125, 0.375, 2.675, 1.005, 7.123455, 999.995, 1234567.891, -1234.5678,
                                1e-9, 123456789012.345, 0.5, 1.5, 2.5, -2.5, 3.4999999};
  for (int i = 0; i < 40; ++i) values.push_back(std::pow(10.0, unit(rng) * 10 - 3) * (i % 5 == 0 ? -1 : 1));
  for (double v : values) {
    for (auto [decimals, width, thousands] : {std::tuple{2, 0, true}, std::tuple{5, 8, false}, std::tuple{4, 7, false},
                                              std::tuple{2, 5, false}, std::tuple{2, 0, false}, std::tuple{0, 0, true}}) {
      cases["fixed"].push_back({v, decimals, width, thousands});
    }
    cases["rounds"].push_back(v);
  }
  for (int i = 0; i < 30; ++i) {
    cases["lines"].push_back({{"step", i == 0 ? 1 : static_cast<int64_t>(unit(rng) * 100000)},
                              {"loss", unit(rng) * 12},
                              {"grad_norm", unit(rng) * (i % 3 == 0 ? 100 : 2)},
                              {"memory_gib", unit(rng) * 140},
                              {"memory_pct", unit(rng) * 100},
                              {"tps", unit(rng) * (i % 2 ? 1e7 : 1e3)},
                              {"tflops", unit(rng) * (i % 4 ? 1e3 : 3e3)},
                              {"mfu_pct", i % 5 == 0 ? nlohmann::json(nullptr) : nlohmann::json(unit(rng) * 100)},
                              {"color", i % 2 == 0}});
  }
  const nlohmann::json expected = run_reference(cases);

  for (size_t i = 0; i < cases["ints"].size(); ++i) {
    EXPECT_EQ(format_thousands(cases["ints"][i].get<int64_t>()), expected["ints"][i].get<std::string>());
  }
  for (size_t i = 0; i < cases["fixed"].size(); ++i) {
    const auto& c = cases["fixed"][i];
    EXPECT_EQ(format_fixed(c[0].get<double>(), c[1].get<int>(), c[2].get<int>(), c[3].get<bool>()),
              expected["fixed"][i].get<std::string>())
        << c.dump();
  }
  for (size_t i = 0; i < cases["rounds"].size(); ++i) {
    EXPECT_EQ(round_half_even(cases["rounds"][i].get<double>()), expected["rounds"][i].get<int64_t>()) << cases["rounds"][i];
  }
  for (size_t i = 0; i < cases["lines"].size(); ++i) {
    const auto& c = cases["lines"][i];
    EXPECT_EQ(format_log_line(fields_of(c), c["color"].get<bool>()), expected["lines"][i].get<std::string>()) << c.dump();
  }
}

TEST(MetricsFormat, NonFiniteValues) {
  EXPECT_EQ(format_fixed(std::nan(""), 4, 7), "    nan");
  EXPECT_EQ(format_fixed(-std::nan(""), 4, 7), "    nan");
  EXPECT_EQ(format_fixed(std::numeric_limits<double>::infinity(), 2, 0, true), "inf");
  EXPECT_EQ(format_fixed(-std::numeric_limits<double>::infinity(), 5, 8), "    -inf");
}

TEST(MetricsFormat, MoeModelsAddTheLoadImbalanceAfterTorchtitansFields) {
  LogLineFields f;
  f.step = 3;
  f.loss = 7.5;
  f.tps = 100;
  const std::string plain = format_log_line(f, false);
  f.moe_imbalance = 1.234;
  f.moe_imbalance_max = 1.875;
  const std::string moe = format_log_line(f, false);
  EXPECT_EQ(moe, plain + "  moe_imbalance: 1.23 (max 1.88)");
  std::smatch m;
  EXPECT_TRUE(std::regex_search(moe, m, log_line_regex())) << moe;  // users' parsers still read it
  EXPECT_EQ(strip_ansi(format_log_line(f, true)), moe);
  f.moe_aux_loss = 2.00503814;  // with the auxiliary load-balancing loss
  const std::string aux = format_log_line(f, false);
  EXPECT_EQ(aux, moe + "  moe_aux_loss: 2.0050");
  EXPECT_TRUE(std::regex_search(aux, m, log_line_regex())) << aux;
  EXPECT_EQ(strip_ansi(format_log_line(f, true)), aux);
}

TEST(MetricsFormat, LineParsesWithUsersRegex) {
  LogLineFields f;
  f.step = 10;
  f.loss = 7.123449;
  f.grad_norm = 1.02134;
  f.memory_gib = 36.2;
  f.memory_pct = 81.5;
  f.tps = 1710.4;
  f.tflops = 1098.123;
  f.mfu_pct = 23.5;
  for (bool color : {false, true}) {
    const std::string line = format_log_line(f, color);
    EXPECT_EQ(color, line.find('\033') != std::string::npos);
    std::smatch m;
    const std::string plain = strip_ansi(line);
    ASSERT_TRUE(std::regex_search(plain, m, log_line_regex())) << plain;
    EXPECT_EQ(std::stoll(m[1]), 10);
    EXPECT_NEAR(std::stod(m[2]), f.loss, 0.5e-5);
    EXPECT_NEAR(std::stod(m[3]), f.grad_norm, 0.5e-4);
    EXPECT_NEAR(std::stod(m[4]), f.memory_gib, 0.005);
    EXPECT_NEAR(std::stod(m[5]), f.memory_pct, 0.005);
    EXPECT_EQ(std::stoll(remove_commas(m[6])), 1710);
    EXPECT_NEAR(std::stod(remove_commas(m[7])), f.tflops, 0.005);
    EXPECT_NEAR(std::stod(m[8]), 23.5, 0.005);
  }
  f.mfu_pct.reset();
  std::smatch m;
  const std::string line = format_log_line(f, false);
  ASSERT_TRUE(std::regex_search(line, m, log_line_regex())) << line;
  EXPECT_FALSE(m[8].matched);
  EXPECT_NE(line.find("mfu: N/A"), std::string::npos);
}

TEST(MetricsFormat, Duration) {
  EXPECT_EQ(format_duration(195), "0:03:15");
  EXPECT_EQ(format_duration(0), "0:00:00");
  EXPECT_EQ(format_duration(-3), "0:00:00");
  EXPECT_EQ(format_duration(3600 * 27 + 61.4), "27:01:01");
}

}  // namespace
}  // namespace titan::metrics
