// JSON Lines reading: plain, gzip and zstd files alike, folder listing, seeking to saved positions,
// and the errors a user sees for bad data.
#include "data/data_test_util.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/data/document_reader.h"

#include <gtest/gtest.h>

#include <filesystem>

namespace titan {
namespace {

using test::read_all;

using data::DocPos;
using data::DocumentReader;

std::vector<std::string> sample_docs() {
  std::vector<std::string> docs = {"first document", "", "second\nwith a newline and \"quotes\"", "ünïcödé ✓",
                                   std::string(3000, 'x')};
  for (int i = 0; i < 40; ++i) docs.push_back("document number " + std::to_string(i));
  return docs;
}


std::string expect_user_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no UserError thrown";
  return {};
}

// Writes the same documents as .jsonl, .jsonl.gz (two members) and .jsonl.zst (two frames), with a
// blank line and Windows line ends in the middle; returns the three paths.
std::vector<std::string> write_all_kinds(const test::TempDir& dir, const std::vector<std::string>& docs) {
  std::string all = test::jsonl(docs);
  size_t cut = all.find('\n', all.size() / 2) + 1;
  std::string first = all.substr(0, cut) + "\n   \n", second = all.substr(cut);
  // CRLF for the first line of the second half.
  second.insert(second.find('\n'), "\r");
  test::write_file(dir / "a.jsonl", first + second);
  test::write_gzip(dir / "b.jsonl.gz", {first, second});
  test::write_file(dir / "c.jsonl.zst", test::zstd_bytes({first, second}));
  return {dir / "a.jsonl", dir / "b.jsonl.gz", dir / "c.jsonl.zst"};
}

TEST(DataJsonl, PlainGzipAndZstdReadAlike) {
  test::TempDir dir;
  auto docs = sample_docs();
  for (const auto& path : write_all_kinds(dir, docs)) {
    DocumentReader r({path}, "text");
    EXPECT_EQ(read_all(r), docs) << path;
  }
}

TEST(DataJsonl, LongLinesAcrossReadChunks) {
  // Documents longer than the 1 MiB read chunk, in a multi-frame zstd file.
  test::TempDir dir;
  std::vector<std::string> docs = {std::string(1500000, 'a'), "short", std::string(2100000, 'b') + "end"};
  std::string all = test::jsonl(docs);
  test::write_file(dir / "long.jsonl.zst", test::zstd_bytes({all.substr(0, 700000), all.substr(700000)}));
  DocumentReader r({dir / "long.jsonl.zst"}, "text");
  EXPECT_EQ(read_all(r), docs);
}

TEST(DataJsonl, FolderFilesInSortedOrderAndOnlyDataFiles) {
  test::TempDir dir;
  std::filesystem::create_directories(dir / "sub");
  test::write_file(dir / "b.jsonl", test::jsonl({"b"}));
  test::write_gzip(dir / "a.json.gz", {test::jsonl({"a"})});
  test::write_file(dir / "sub/c.jsonl.zst", test::zstd_bytes({test::jsonl({"c"})}));
  test::write_file(dir / "README.txt", "not data");
  auto files = data::list_data_files(dir.path());
  ASSERT_EQ(files.size(), 3u);
  DocumentReader r(files, "text");
  EXPECT_EQ(read_all(r), (std::vector<std::string>{"a", "b", "c"}));
}

TEST(DataJsonl, AllenaiC4LayoutPicksTheSplit) {
  test::TempDir dir;
  std::filesystem::create_directories(dir / "en");
  std::filesystem::create_directories(dir / "realnewslike");
  test::write_gzip(dir / "en/c4-train.00001-of-00002.json.gz", {test::jsonl({"t1"})});
  test::write_gzip(dir / "en/c4-train.00000-of-00002.json.gz", {test::jsonl({"t0"})});
  test::write_gzip(dir / "en/c4-validation.00000-of-00001.json.gz", {test::jsonl({"v0"})});
  test::write_gzip(dir / "realnewslike/c4-train.00000-of-00001.json.gz", {test::jsonl({"r0"})});
  DocumentReader train(data::list_data_files(dir.path(), "train"), "text");
  EXPECT_EQ(read_all(train), (std::vector<std::string>{"t0", "t1"}));
  DocumentReader val(data::list_data_files(dir.path(), "validation"), "text");
  EXPECT_EQ(read_all(val), (std::vector<std::string>{"v0"}));
}

TEST(DataJsonl, SeekContinuesAtASavedPosition) {
  test::TempDir dir;
  auto docs = sample_docs();
  auto paths = write_all_kinds(dir, docs);
  for (const auto& path : paths) {
    DocumentReader r({path}, "text");
    std::vector<DocPos> pos;
    read_all(r, &pos);
    for (size_t k : {size_t{0}, size_t{3}, docs.size() / 2 + 1, docs.size() - 1}) {
      DocumentReader again({path}, "text");
      again.seek(pos[k]);
      std::vector<DocPos> rest_pos;
      auto rest = read_all(again, &rest_pos);
      EXPECT_EQ(rest, std::vector<std::string>(docs.begin() + k, docs.end())) << path << " from " << k;
      EXPECT_EQ(rest_pos, std::vector<DocPos>(pos.begin() + k, pos.end())) << path << " from " << k;
    }
  }
  // Across files, with an epoch stamp.
  DocumentReader multi(paths, "text");
  multi.rewind(3);
  std::vector<DocPos> pos;
  auto all = read_all(multi, &pos);
  ASSERT_EQ(all.size(), 3 * docs.size());
  DocumentReader again(paths, "text");
  again.seek(pos[docs.size() + 2]);
  EXPECT_EQ(read_all(again).size(), 2 * docs.size() - 2);
  EXPECT_EQ(pos.back().epoch, 3);
  EXPECT_EQ(pos.back().file, 2);
}

TEST(DataJsonl, ClearErrors) {
  test::TempDir dir;
  std::string msg = expect_user_error([&] { data::list_data_files(dir / "absent"); });
  EXPECT_NE(msg.find("dataset_path"), std::string::npos) << msg;
  msg = expect_user_error([&] { data::list_data_files(dir.path()); });
  EXPECT_NE(msg.find("holds no data file"), std::string::npos) << msg;

  test::write_file(dir / "nofield.jsonl", "{\"text\": \"ok\"}\n{\"content\": \"x\", \"url\": \"u\"}\n");
  msg = expect_user_error([&] {
    DocumentReader r({dir / "nofield.jsonl"}, "text");
    read_all(r);
  });
  EXPECT_NE(msg.find("nofield.jsonl:2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'text'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("content, url"), std::string::npos) << msg;
  // The field name is configurable.
  DocumentReader content({dir / "nofield.jsonl"}, "content");
  EXPECT_THROW(read_all(content), UserError);  // line 1 has no "content"

  test::write_file(dir / "bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"text\": \"unterminated}\n");
  msg = expect_user_error([&] {
    DocumentReader r({dir / "bad.jsonl"}, "text");
    read_all(r);
  });
  EXPECT_NE(msg.find("bad.jsonl:3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("malformed JSON"), std::string::npos) << msg;

  // A number beyond a double's range is the parser's out_of_range, not a parse error: still a user error.
  test::write_file(dir / "huge.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"b\", \"score\": 2e22222222226}\n");
  msg = expect_user_error([&] {
    DocumentReader r({dir / "huge.jsonl"}, "text");
    read_all(r);
  });
  EXPECT_NE(msg.find("huge.jsonl:2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("number overflow"), std::string::npos) << msg;

  test::write_file(dir / "array.json", "[{\"text\": \"a\"}, {\"text\": \"b\"}]\n");
  msg = expect_user_error([&] {
    DocumentReader r({dir / "array.json"}, "text");
    read_all(r);
  });
  EXPECT_NE(msg.find("one object per line"), std::string::npos) << msg;

  test::write_file(dir / "number.jsonl", "{\"text\": 5}\n");
  msg = expect_user_error([&] {
    DocumentReader r({dir / "number.jsonl"}, "text");
    read_all(r);
  });
  EXPECT_NE(msg.find("expected a string"), std::string::npos) << msg;

  // Truncated compressed files.
  std::string big = test::jsonl(sample_docs());
  std::string z = test::zstd_bytes({big});
  test::write_file(dir / "cut.jsonl.zst", z.substr(0, z.size() / 2));
  msg = expect_user_error([&] {
    DocumentReader r({dir / "cut.jsonl.zst"}, "text");
    read_all(r);
  });
  EXPECT_NE(msg.find("cut.jsonl.zst"), std::string::npos) << msg;
  test::write_gzip(dir / "full.jsonl.gz", {big});
  std::ifstream in(dir / "full.jsonl.gz", std::ios::binary);
  std::string gz((std::istreambuf_iterator<char>(in)), {});
  test::write_file(dir / "cut.jsonl.gz", gz.substr(0, gz.size() / 2));
  msg = expect_user_error([&] {
    DocumentReader r({dir / "cut.jsonl.gz"}, "text");
    read_all(r);
  });
  EXPECT_NE(msg.find("cut.jsonl.gz"), std::string::npos) << msg;
}

}  // namespace
}  // namespace titan
