// load_tokenizer's dispatch and its errors on bad input: missing paths, empty folders, corrupt or
// unsupported tokenizer.json files, malformed tiktoken files, unknown files, bad ids.
#include "fuzz_regressions.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/tokenizer/tokenizer.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace titan {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string asset(const std::string& name) { return std::string(TITAN_SOURCE_DIR) + "/assets/tokenizer/" + name; }

// The UserError message of load_tokenizer(path); fails the test when it loads.
std::string load_error(const std::string& path) {
  try {
    load_tokenizer(path);
  } catch (const UserError& e) {
    return e.what();
  }
  ADD_FAILURE() << "load_tokenizer(" << path << ") did not throw";
  return "";
}

void write(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

json test_json() {
  std::ifstream in(asset("tokenizer.json"));
  return json::parse(in);
}

TEST(TokenizerLoad, DispatchesByFileAndFolder) {
  test::TempDir dir;
  // Folder order: tokenizer.json, then tokenizer.model, then original/tokenizer.model.
  fs::create_directories(dir / "original");
  fs::copy_file(asset("tiktoken.model"), dir / "original/tokenizer.model");
  EXPECT_EQ(load_tokenizer(dir.path())->vocab_size(), 2048);  // tiktoken: 1792 + 256 specials
  fs::copy_file(asset("sentencepiece.model"), dir / "tokenizer.model");
  auto sp = load_tokenizer(dir.path());
  EXPECT_EQ(sp->bos_id(), 1);  // SentencePiece model's ids (bos 1, eos 2)
  fs::copy_file(asset("tokenizer.json"), dir / "tokenizer.json");
  auto hf = load_tokenizer(dir.path());
  EXPECT_EQ(hf->bos_id(), 0);  // tokenizer.json's <|begin_of_text|>
  EXPECT_EQ(hf->eos_id(), 1);
  // Files are recognized by content, not by name.
  fs::copy_file(asset("tiktoken.model"), dir / "ranks.txt");
  EXPECT_EQ(load_tokenizer(dir / "ranks.txt")->bos_id(), 1792);
}

TEST(TokenizerLoad, TokenizerConfigNamesBosAndEos) {
  test::TempDir dir;
  fs::copy_file(asset("tokenizer.json"), dir / "tokenizer.json");
  write(dir / "tokenizer_config.json",
        R"({"bos_token": {"content": "<|end_of_text|>"}, "eos_token": "<|begin_of_text|>"})");
  auto tok = load_tokenizer(dir.path());
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 0);
}

TEST(TokenizerLoad, MissingPaths) {
  test::TempDir dir;
  EXPECT_NE(load_error(dir / "nope").find("does not exist"), std::string::npos);
  EXPECT_NE(load_error(dir / "nope").find("hf_assets_path"), std::string::npos);
  const std::string msg = load_error(dir.path());
  EXPECT_NE(msg.find("tokenizer.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir.path()), std::string::npos) << msg;
}

TEST(TokenizerLoad, CorruptJson) {
  test::TempDir dir;
  write(dir / "tokenizer.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {");
  EXPECT_NE(load_error(dir / "tokenizer.json").find("JSON parse error"), std::string::npos);
  write(dir / "tokenizer.json", "[1, 2, 3]");
  EXPECT_NE(load_error(dir / "tokenizer.json").find("no \"model\""), std::string::npos);
}

TEST(TokenizerLoad, UnsupportedTokenizerJson) {
  test::TempDir dir;
  const std::string path = dir / "tokenizer.json";
  auto expect_rejected = [&](const json& j, const std::string& fragment) {
    write(path, j.dump());
    const std::string msg = load_error(path);
    EXPECT_NE(msg.find("unsupported"), std::string::npos) << msg;
    EXPECT_NE(msg.find(fragment), std::string::npos) << msg;
  };
  json j = test_json();
  j["model"]["type"] = "WordPiece";
  expect_rejected(j, "WordPiece");
  j = test_json();
  j["normalizer"] = {{"type", "NFC"}};
  expect_rejected(j, "NFC");
  j = test_json();
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_rejected(j, "Whitespace");
  j = test_json();
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "MergedWithNext";
  expect_rejected(j, "MergedWithNext");
  j = test_json();
  j["decoder"] = {{"type", "Metaspace"}};
  expect_rejected(j, "Metaspace");
  j = test_json();
  j["added_tokens"][0]["lstrip"] = true;
  expect_rejected(j, "lstrip");
  j = test_json();
  j["model"]["dropout"] = 0.1;
  expect_rejected(j, "dropout");
  j = test_json();
  j["pre_tokenizer"] = j["pre_tokenizer"]["pretokenizers"][0];  // Split alone: not byte-level
  expect_rejected(j, "ByteLevel");
}

TEST(TokenizerLoad, BadMergesAndVocab) {
  test::TempDir dir;
  const std::string path = dir / "tokenizer.json";
  json j = test_json();
  j["model"]["merges"].push_back(json::array({"zzz", "yyy"}));
  write(path, j.dump());
  EXPECT_NE(load_error(path).find("not in the vocabulary"), std::string::npos);
  j = test_json();
  j["model"]["vocab"].erase("A");  // the byte 'A' is missing
  j["model"]["merges"] = json::array();
  write(path, j.dump());
  EXPECT_NE(load_error(path).find("0x41"), std::string::npos);
  j = test_json();
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  write(path, j.dump());
  EXPECT_NE(load_error(path).find("does not compile"), std::string::npos);
}

TEST(TokenizerLoad, BadTiktokenAndUnknownFiles) {
  test::TempDir dir;
  write(dir / "a.model", "IQ== 0\nIg== 1\n!!!! 2\n");
  EXPECT_NE(load_error(dir / "a.model").find(":3: not a tiktoken line"), std::string::npos);
  write(dir / "b.model", "IQ== 0\nIg== 5\n");
  EXPECT_NE(load_error(dir / "b.model").find("out of order"), std::string::npos);
  write(dir / "c.model", "IQ== 0\nIg== 1\n");  // lacks most single bytes
  EXPECT_NE(load_error(dir / "c.model").find("single byte"), std::string::npos);
  write(dir / "d.bin", std::string("\x01\x02garbage\xff\xfe", 11));
  const std::string msg = load_error(dir / "d.bin");
  EXPECT_NE(msg.find("neither a tokenizer.json"), std::string::npos) << msg;
}

// Found by fuzzing (tests/fuzz/regressions/tokenizer_hf/huge_token_id): an added token with id
// 2147483000 once sized the id table to 2^31 entries.
TEST(TokenizerLoad, ATokenIdFarBeyondTheTokensListedIsRejected) {
  test::TempDir dir;
  write(dir / "tokenizer.json", test::fuzz_regression_files("tokenizer_hf", "huge_token_id").at(0));
  const std::string msg = load_error(dir / "tokenizer.json");
  EXPECT_NE(msg.find("token id 2147483000 for '<|end_of_text|>' is far beyond the 322 tokens the file lists"),
            std::string::npos) << msg;
}

// Found by fuzzing (tests/fuzz/regressions/tokenizer_hf/float_token_id): a vocabulary id written as
// 7.7e127 was converted to int32 with a cast (undefined behaviour).
TEST(TokenizerLoad, ATokenIdThatIsNotAnIntegerIsRejected) {
  test::TempDir dir;
  write(dir / "tokenizer.json", test::fuzz_regression_files("tokenizer_hf", "float_token_id").at(0));
  const std::string msg = load_error(dir / "tokenizer.json");
  EXPECT_NE(msg.find("is not an integer"), std::string::npos) << msg;
  json j = test_json();
  j["added_tokens"][0]["id"] = 4294967296;  // an integer, but not an int32
  write(dir / "tokenizer.json", j.dump());
  EXPECT_NE(load_error(dir / "tokenizer.json").find("malformed tokenizer.json"), std::string::npos);
}

TEST(TokenizerLoad, DecodeRejectsUnknownIds) {
  for (const char* file : {"tokenizer.json", "tiktoken.model", "sentencepiece.model"}) {
    auto tok = load_tokenizer(asset(file));
    EXPECT_THROW(tok->decode({5, static_cast<int32_t>(tok->vocab_size())}), UserError) << file;
    EXPECT_THROW(tok->decode({-1}), UserError) << file;
  }
}

}  // namespace
}  // namespace titan
