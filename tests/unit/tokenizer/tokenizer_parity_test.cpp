// Token-for-token parity of titan's tokenizers with the Python packages (tests/reference/
// tokenizer_reference.py): `tokenizers` for tokenizer.json, `tiktoken` for tiktoken models and
// `sentencepiece` for SentencePiece models, on the test tokenizers of assets/tokenizer/ and on
// variants of tokenizer.json exercising the other supported features. Ids must be equal exactly;
// decoding must give the reference's string exactly.
#include "test_util.h"
#include "tokenizer/parity_texts.h"

#include "titan/components/tokenizer/tokenizer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <thread>

namespace titan {
namespace {

using nlohmann::json;

std::string asset(const std::string& name) { return std::string(TITAN_SOURCE_DIR) + "/assets/tokenizer/" + name; }
std::string reference_script() { return std::string(TITAN_SOURCE_DIR) + "/tests/reference/tokenizer_reference.py"; }

json run_reference(const test::TempDir& dir, const std::string& kind, const std::string& path,
                   const std::vector<std::string>& texts) {
  {
    std::ofstream(dir / "request.json") << json{{"kind", kind}, {"path", path}, {"texts", texts}}.dump();
  }
  const auto r = test::run_process({test::python(), reference_script(), "encode", dir / "request.json",
                                    dir / "response.json"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir / "response.json");
  return json::parse(in);
}

std::string show(const std::vector<int32_t>& ids) { return json(ids).dump(); }

// Compares titan's tokenizer at `path` with the reference on the parity texts.
// `bos_eos_both`: the reference's ids_with_specials add both BOS and EOS (tiktoken, SentencePiece);
// otherwise they are the tokenizer.json post-processor's output, compared with add_bos only.
void expect_parity(const std::string& kind, const std::string& path, bool bos_eos_both) {
  test::TempDir dir;
  const std::vector<std::string> texts = test::parity_texts();
  const json ref = run_reference(dir, kind, path, texts);
  auto tok = load_tokenizer(path);
  EXPECT_EQ(tok->vocab_size(), ref["vocab_size"].get<int64_t>());
  EXPECT_EQ(tok->bos_id(), ref["bos"].is_null() ? std::nullopt : std::optional<int32_t>(ref["bos"].get<int32_t>()));
  EXPECT_EQ(tok->eos_id(), ref["eos"].is_null() ? std::nullopt : std::optional<int32_t>(ref["eos"].get<int32_t>()));
  for (size_t i = 0; i < texts.size(); ++i) {
    SCOPED_TRACE("text " + std::to_string(i) + ": " + json(texts[i]).dump());
    const std::vector<int32_t> ids = tok->encode(texts[i]);
    const auto expected = ref["ids"][i].get<std::vector<int32_t>>();
    EXPECT_EQ(ids, expected) << "titan " << show(ids) << "\nref   " << show(expected);
    // add_bos gives exactly one leading BOS, also when the post-processor adds none (GPT-2 style).
    auto expected_with = ref["ids_with_specials"][i].get<std::vector<int32_t>>();
    if (tok->bos_id() && expected_with.size() == expected.size()) {
      expected_with.insert(expected_with.begin(), *tok->bos_id());
    }
    EXPECT_EQ(tok->encode(texts[i], /*add_bos=*/true, /*add_eos=*/bos_eos_both), expected_with);
    EXPECT_EQ(tok->decode(expected), ref["decoded"][i].get<std::string>());
  }
}

TEST(TokenizerParity, HuggingFaceTestTokenizer) { expect_parity("hf", asset("tokenizer.json"), false); }

TEST(TokenizerParity, Tiktoken) { expect_parity("tiktoken", asset("tiktoken.model"), true); }

TEST(TokenizerParity, SentencePiece) { expect_parity("sentencepiece", asset("sentencepiece.model"), true); }

// Variants of tokenizer.json: merges as "a b" strings, GPT-2 style ByteLevel pre-tokenizer with
// add_prefix_space and no ignore_merges, added special and non-special tokens.
TEST(TokenizerParity, HuggingFaceVariants) {
  test::TempDir dir;
  const auto r = test::run_process({test::python(), reference_script(), "variants", asset("tokenizer.json"), dir.path()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* name : {"merges_as_strings.json", "gpt2_style.json", "added_tokens.json"}) {
    SCOPED_TRACE(name);
    expect_parity("hf", dir / name, false);
  }
}

// Byte-level tokenizers are lossless: decode(encode(text)) == text for any valid UTF-8.
TEST(TokenizerParity, RoundTrip) {
  for (const char* file : {"tokenizer.json", "tiktoken.model"}) {
    auto tok = load_tokenizer(asset(file));
    for (const std::string& text : test::parity_texts()) {
      EXPECT_EQ(tok->decode(tok->encode(text)), text) << file << ": " << json(text).dump();
      EXPECT_EQ(tok->decode(tok->encode(text, true, true)),
                tok->decode({*tok->bos_id()}) + text + tok->decode({*tok->eos_id()}));
    }
  }
}

// Ill-formed UTF-8 is tokenized as if each ill-formed part were U+FFFD.
TEST(TokenizerParity, InvalidUtf8IsReplaced) {
  for (const char* file : {"tokenizer.json", "tiktoken.model"}) {
    auto tok = load_tokenizer(asset(file));
    EXPECT_EQ(tok->encode("ab\xff" "cd \xe2\x82 x \xc0\xaf"),
              tok->encode("ab\xEF\xBF\xBD" "cd \xEF\xBF\xBD x \xEF\xBF\xBD\xEF\xBF\xBD"));
  }
}

// The per-word cache does not change results: a fresh tokenizer and a warmed one agree, also when
// encode runs on several threads at once.
TEST(TokenizerParity, CacheAndThreads) {
  auto cold = load_tokenizer(asset("tokenizer.json"));
  auto warm = load_tokenizer(asset("tokenizer.json"));
  std::string text;
  for (const auto& t : test::parity_texts()) text += t;
  const auto expected = cold->encode(text);
  std::vector<std::thread> threads;
  std::vector<std::vector<int32_t>> results(4);
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < 20; ++k) results[i] = warm->encode(text);
    });
  }
  for (auto& th : threads) th.join();
  for (const auto& r : results) EXPECT_EQ(r, expected);
}

}  // namespace
}  // namespace titan
