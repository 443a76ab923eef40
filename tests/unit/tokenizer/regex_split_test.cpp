// The pre-tokenizer regex (PCRE2) splits texts into the same pieces as the `tokenizers` package's
// Split pre-tokenizer with Llama 3's pattern (Oniguruma), including where PCRE2's own \s would differ
// (U+180E), on the parity texts.
#include "test_util.h"
#include "tokenizer/parity_texts.h"

#include "titan/components/tokenizer/regex_split.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>

namespace titan {
namespace {

using nlohmann::json;

TEST(TokenizerRegex, Llama3PatternPiecesMatchTokenizers) {
  test::TempDir dir;
  std::vector<std::string> texts = test::parity_texts();
  texts.push_back("x\u180eword \u180e\u180e  y\u0085z");
  {
    std::ofstream(dir / "request.json")
        << json{{"path", std::string(TITAN_SOURCE_DIR) + "/assets/tokenizer/tokenizer.json"}, {"texts", texts}}.dump();
  }
  const auto r = test::run_process({test::python(), std::string(TITAN_SOURCE_DIR) + "/tests/reference/tokenizer_reference.py",
                                    "pretokenize", dir / "request.json", dir / "response.json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir / "response.json");
  const json ref = json::parse(in);
  tokenizer::RegexSplitter split(tokenizer::kLlama3Pattern, false, "test");
  for (size_t i = 0; i < texts.size(); ++i) {
    std::vector<std::string> pieces;
    split.split(texts[i], [&](size_t b, size_t e, bool) { pieces.push_back(texts[i].substr(b, e - b)); });
    EXPECT_EQ(json(pieces), ref["pieces"][i]) << "text " << i;
  }
}

TEST(TokenizerRegex, WhitespaceRewrite) {
  const std::string ws = R"(\t-\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
  EXPECT_EQ(tokenizer::rewrite_whitespace_classes(R"(\s+(?!\S)|[^\s\p{L}]|\\s)"),
            "[" + ws + "]+(?![^" + ws + "])|[^" + ws + R"(\p{L}]|\\s)");
}

}  // namespace
}  // namespace titan
