// Damaged token shard folders found by fuzzing (tests/fuzz/regressions/token_shards/): counts that
// overflow the size arithmetic, token ids beyond the vocabulary and incomplete manifest entries are
// UserErrors naming the shard or the manifest, and leave no file open.
#include "fuzz_regressions.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/data/token_shards.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace titan::data {
namespace {

// The tokenizer the regression folders were written for: only its vocabulary size and ids matter.
class Vocab2048 final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view, bool, bool) const override { return {}; }
  std::string decode(const std::vector<int32_t>&) const override { return {}; }
  int64_t vocab_size() const override { return 2048; }
  std::optional<int32_t> bos_id() const override { return 0; }
  std::optional<int32_t> eos_id() const override { return 1; }
};

void write_folder(const test::TempDir& dir, const std::string& regression) {
  const auto files = test::fuzz_regression_files("token_shards", regression);
  test::write_bytes(dir / "manifest.json", files.at(0));
  for (size_t i = 1; i < files.size(); ++i) test::write_bytes(dir / ("shard-0000" + std::to_string(i - 1) + ".bin"), files[i]);
}

TEST(DataShardsCorrupt, ATokenCountThatOverflowsTheSizeCheckIsTooLargeForTheFile) {
  test::TempDir dir;
  write_folder(dir, "num_tokens_overflow");  // num_tokens 2^62 + 9 in both manifest and header
  Vocab2048 tok;
  try {
    ShardWindowSource source(dir.path(), tok, 7);
    FAIL() << "a shard of 120 bytes claiming 2^62 tokens was opened";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("has 120 bytes, too few for the 4611686018427387913 tokens"), std::string::npos)
        << e.what();
  }
}

TEST(DataShardsCorrupt, ATokenIdBeyondTheVocabularyNamesTheShard) {
  test::TempDir dir;
  write_folder(dir, "token_id_beyond_vocabulary");  // token 2 of shard 0 is 5000
  Vocab2048 tok;
  ShardWindowSource source(dir.path(), tok, 7);
  std::vector<int32_t> window(8);
  try {
    source.read(window.data());
    FAIL() << "token id 5000 was read with a vocabulary of 2048";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("shard-00000.bin' holds token id 5000, outside the tokenizer's vocabulary of 2048"),
              std::string::npos) << e.what();
  }
}

int open_fds() {
  int n = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd"); it != std::filesystem::directory_iterator(); ++it) ++n;
  return n;
}

TEST(DataShardsCorrupt, AShardEntryWithoutItsDocumentCountLeavesNoFileOpen) {
  test::TempDir dir;
  write_folder(dir, "shard_entry_without_num_documents");
  Vocab2048 tok;
  const int fds = open_fds();
  try {
    ShardWindowSource source(dir.path(), tok, 7);
    FAIL() << "a manifest entry without num_documents was accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("key 'num_documents' not found"), std::string::npos) << e.what();
  }
  EXPECT_EQ(open_fds(), fds) << "the shard opened before the manifest entry was rejected stayed open";
}

}  // namespace
}  // namespace titan::data
