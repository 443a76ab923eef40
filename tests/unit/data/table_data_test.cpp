// Parquet and Arrow IPC data, and Hugging Face datasets folders: the same documents written by pyarrow
// and by Hugging Face `datasets` (tests/reference/table_files_reference.py, run with the project's
// Python) serve the batches of the same documents in JSON Lines; resuming is exact mid-row-group and
// across files and epochs; Hub cache folders, save_to_disk and cache folders are read by split; damaged
// files are errors naming the file; `titan tokenize` writes the shards of the JSON Lines.
#include "data/data_test_util.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/data/dataloader.h"
#include "titan/components/data/document_reader.h"
#include "titan/components/data/hub_configs.h"
#include "titan/components/data/table_reader.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace titan {
namespace {

using test::expect_same;
using test::read_all;
using test::take;

namespace fs = std::filesystem;
using data::Batch;
using data::DocPos;
using data::DocumentReader;
using data::TableReader;
using nlohmann::json;
using test::config;

const std::string kReference = std::string(TITAN_SOURCE_DIR) + "/tests/reference/table_files_reference.py";
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";

// Documents of varied lengths: empty, multi-byte UTF-8, newlines, some longer than a window.
std::vector<std::string> table_docs(int n = 40, int salt = 0) {
  std::vector<std::string> docs;
  for (int i = 0; i < n; ++i) {
    std::string d = "doc" + std::to_string(i + salt) + ":";
    for (int j = 0; j < (i * 11 + salt) % 37; ++j) d += static_cast<char>('a' + (i + j + salt) % 26);
    docs.push_back(d);
  }
  if (n > 13) {
    docs[3] = "";
    docs[8] = "ünïcödé ✓ line one\nline two";
    docs[13] = std::string(120, 'L');
  }
  return docs;
}

// Runs the writer over `specs` (one Python process); its output (one JSON line per Parquet file).
std::string write_tables(const test::TempDir& dir, const json& specs) {
  const std::string spec_file = dir / "spec.json";
  test::write_file(spec_file, specs.dump());
  auto r = test::run_process({test::python(), kReference, spec_file});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.output;
}




std::vector<std::string> names_of(const std::vector<std::string>& files, const std::string& root) {
  std::vector<std::string> out;
  for (const auto& f : files) out.push_back(fs::path(f).lexically_relative(root).string());
  return out;
}

// Every kind of table file and folder, holding `docs` (the folders: split over several files).
std::vector<std::pair<std::string, json>> table_variants(const test::TempDir& dir, const std::vector<std::string>& docs) {
  const std::vector<std::string> head(docs.begin(), docs.begin() + 17), tail(docs.begin() + 17, docs.end());
  fs::create_directories(dir / "pq_folder");
  return {
      {dir / "rg7.parquet", {{"kind", "parquet"}, {"row_group_size", 7}}},
      {dir / "rg5_large.parquet", {{"kind", "parquet"}, {"row_group_size", 5}, {"type", "large_string"},
                                   {"compression", "zstd"}, {"dictionary", false}}},
      {dir / "stream.arrow", {{"kind", "arrow-stream"}, {"batch_size", 7}}},
      {dir / "stream_view.arrow", {{"kind", "arrow-stream"}, {"batch_size", 6}, {"type", "string_view"}}},
      {dir / "file.arrow", {{"kind", "arrow-file"}, {"batch_size", 7}}},
      {dir / "file_large.arrow", {{"kind", "arrow-file"}, {"batch_size", 9}, {"type", "large_string"}}},
      {dir / "saved", {{"kind", "save-to-disk"}, {"num_shards", 3}}},
      {dir / "hf.parquet", {{"kind", "to-parquet"}, {"batch_size", 7}}},
      {dir / "pq_folder/part-0.parquet", {{"kind", "parquet"}, {"row_group_size", 7}, {"docs", head}}},
      {dir / "pq_folder/part-1.parquet", {{"kind", "parquet"}, {"row_group_size", 4}, {"docs", tail}}},
  };
}

json specs_of(std::vector<std::pair<std::string, json>>& variants, const std::vector<std::string>& docs) {
  json specs = json::array();
  for (auto& [path, spec] : variants) {
    spec["out"] = path;
    if (!spec.contains("docs")) spec["docs"] = docs;
    specs.push_back(spec);
  }
  return specs;
}

TEST(DataTables, ParquetAndArrowServeTheBatchesOfTheSameJsonLines) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  const auto docs = table_docs();
  test::write_file(dir / "docs.jsonl", test::jsonl(docs));
  auto variants = table_variants(dir, docs);
  write_tables(dir, specs_of(variants, docs));
  const int64_t T = static_cast<int64_t>(test::byte_stream(docs).size());
  for (const std::string& path : {dir / "rg7.parquet", dir / "rg5_large.parquet", dir / "stream.arrow",
                                  dir / "stream_view.arrow", dir / "file.arrow", dir / "file_large.arrow",
                                  dir / "saved", dir / "hf.parquet", dir / "pq_folder"}) {
    // The documents, with their positions: (file, row) with line = row + 1.
    DocumentReader reader(data::list_data_files(path), "text");
    std::vector<DocPos> positions;
    EXPECT_EQ(read_all(reader, &positions), docs) << path;
    int64_t file = 0, row = 0;
    for (size_t i = 0; i < positions.size(); ++i) {
      if (positions[i].file != file) {
        EXPECT_EQ(positions[i].file, file + 1) << path;
        file = positions[i].file;
        row = 0;
      }
      EXPECT_EQ(positions[i], (DocPos{0, file, row, row + 1})) << path << " document " << i;
      ++row;
    }
    // The batches, over about three epochs, on one rank and on rank 1 of 3.
    for (int64_t S : {9, 64}) {
      const int steps = static_cast<int>(3 * T / (2 * (S + 1)));
      for (int rank : {0, 1}) {
        const int world = rank == 0 ? 1 : 3;
        auto text = data::make_dataloader(config(dir / "docs.jsonl", 2, S, rank, world), tok);
        auto table = data::make_dataloader(config(path, 2, S, rank, world), tok);
        expect_same(take(*table, steps / world), take(*text, steps / world),
                    path + " S=" + std::to_string(S) + " rank " + std::to_string(rank));
      }
    }
  }
  // The same through a data loader with the text in another column.
  write_tables(dir, json{{"kind", "parquet"}, {"out", dir / "content.parquet"}, {"docs", docs}, {"column", "content"}});
  data::DataConfig c = config(dir / "content.parquet", 2, 9);
  c.text_field = "content";
  auto table = data::make_dataloader(c, tok);
  auto text = data::make_dataloader(config(dir / "docs.jsonl", 2, 9), tok);
  expect_same(take(*table, 40), take(*text, 40), "column content");
}

// TableReader::seek: every row of every kind of file, forwards, backwards and at the end.
TEST(DataTables, SeekReachesEveryRow) {
  test::TempDir dir;
  const auto docs = table_docs(30);
  std::vector<std::pair<std::string, json>> variants = {
      {dir / "rg7.parquet", {{"kind", "parquet"}, {"row_group_size", 7}}},
      {dir / "stream.arrow", {{"kind", "arrow-stream"}, {"batch_size", 7}}},
      {dir / "file.arrow", {{"kind", "arrow-file"}, {"batch_size", 4}}}};
  write_tables(dir, specs_of(variants, docs));
  for (const auto& [path, spec] : variants) {
    TableReader r(path, "text");
    EXPECT_EQ(r.num_rows(), 30) << path;
    std::string text;
    int64_t row = -1;
    for (int64_t start : {0, 1, 6, 7, 8, 13, 14, 29, 3, 27, 0, 20, 2}) {  // row group / batch edges, and back
      r.seek(start);
      for (int64_t k = start; k < std::min<int64_t>(start + 9, 30); ++k) {
        ASSERT_TRUE(r.next(text, row)) << path << " from " << start;
        EXPECT_EQ(row, k) << path << " from " << start;
        EXPECT_EQ(text, docs[static_cast<size_t>(k)]) << path << " row " << k << " from " << start;
      }
    }
    r.seek(30);
    EXPECT_FALSE(r.next(text, row)) << path;
    r.seek(29);
    ASSERT_TRUE(r.next(text, row));
    EXPECT_EQ(row, 29);
    EXPECT_FALSE(r.next(text, row)) << path;
    EXPECT_NE(test::error_of([&] { r.seek(31); }).find("has 30 rows"), std::string::npos) << path;
  }
}

void check_resume(const data::DataConfig& c, const Tokenizer& tok, int before, int after, const std::string& what) {
  auto a = data::make_dataloader(c, tok);
  take(*a, before);
  const std::string state = a->state();
  auto expected = take(*a, after);
  auto b = data::make_dataloader(c, tok);
  b->load_state(state);
  expect_same(take(*b, after), expected, what);
  EXPECT_EQ(a->state(), b->state()) << what;
}

TEST(DataTables, ResumeMidRowGroupIsExactAcrossFilesAndEpochs) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  const auto docs = table_docs();
  auto variants = table_variants(dir, docs);
  write_tables(dir, specs_of(variants, docs));
  const int64_t T = static_cast<int64_t>(test::byte_stream(docs).size());
  for (const std::string& path : {dir / "rg7.parquet", dir / "stream.arrow", dir / "file.arrow", dir / "saved",
                                  dir / "pq_folder"}) {
    for (int64_t S : {5, 13}) {
      const int64_t B = 2;
      const int per_epoch = static_cast<int>(T / (B * (S + 1)));
      for (int before : {1, 3, per_epoch / 2 + 1, per_epoch, per_epoch + 1, 2 * per_epoch + 3}) {
        const std::string what = path + " S=" + std::to_string(S) + " before=" + std::to_string(before);
        check_resume(config(path, B, S), tok, before, per_epoch + 3, what);  // crosses files and an epoch
        check_resume(config(path, B, S, 1, 2), tok, before, 3, what + " rank 1 of 2");
      }
    }
  }
  // The state names the file and the row (offset) of the document being read.
  auto loader = data::make_dataloader(config(dir / "pq_folder", 2, 5), tok);
  take(*loader, 40);
  const json state = json::parse(loader->state()).at("source");
  EXPECT_EQ(state.at("line").get<int64_t>(), state.at("offset").get<int64_t>() + 1) << state.dump();
  EXPECT_EQ(state.at("num_files"), 2) << state.dump();
  // Resuming on changed data: a file with fewer rows than the saved position is an error.
  const std::string saved = loader->state();
  fs::remove_all(dir / "pq_folder");
  fs::create_directories(dir / "pq_folder");
  write_tables(dir, json::array({{{"kind", "parquet"}, {"out", dir / "pq_folder/part-0.parquet"}, {"docs", {"a"}}},
                                 {{"kind", "parquet"}, {"out", dir / "pq_folder/part-1.parquet"}, {"docs", {"b"}}}}));
  auto changed = data::make_dataloader(config(dir / "pq_folder", 2, 5), tok);
  // The files' digest (names and sizes) tells first; a state without one (saved by an earlier version)
  // meets the position check.
  std::string msg = test::error_of([&] { changed->load_state(saved); });
  EXPECT_NE(msg.find("are not the ones the data loader state was saved with"), std::string::npos) << msg;
  json old = json::parse(saved);
  old["source"].erase("files_digest");
  msg = test::error_of([&] { changed->load_state(old.dump()); });
  EXPECT_NE(msg.find("part-"), std::string::npos) << msg;
  EXPECT_NE(msg.find("saved position"), std::string::npos) << msg;
}

// A Hugging Face Hub cache folder, built as huggingface_hub lays it out: blobs named by hash,
// snapshots/<rev>/ whose files link into blobs/, refs/main naming the revision.
void link_blob(const fs::path& repo, const std::string& rev, const std::string& rel, const std::string& blob) {
  const fs::path link = repo / "snapshots" / rev / rel;
  fs::create_directories(link.parent_path());
  fs::path target = fs::relative(repo / "blobs" / blob, link.parent_path());
  fs::create_symlink(target, link);
}

TEST(DataHuggingFace, HubCacheFolderReadsItsSnapshotBySplit) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  const auto train = table_docs(30), validation = table_docs(9, 100), old = table_docs(5, 200);
  const fs::path repo = dir / "datasets--org--name";
  fs::create_directories(repo / "blobs");
  fs::create_directories(repo / "refs");
  const std::vector<std::string> t0(train.begin(), train.begin() + 16), t1(train.begin() + 16, train.end());
  write_tables(dir, json::array({
                        {{"kind", "parquet"}, {"out", (repo / "blobs/a1b2").string()}, {"docs", t0}},
                        {{"kind", "parquet"}, {"out", (repo / "blobs/c3d4").string()}, {"docs", t1}},
                        {{"kind", "parquet"}, {"out", (repo / "blobs/e5f6").string()}, {"docs", validation}},
                        {{"kind", "parquet"}, {"out", (repo / "blobs/0ld0").string()}, {"docs", old}},
                    }));
  test::write_file(repo / "blobs/readme", "---\ndataset_info:\n  features: []\n---\n# A dataset\n");
  test::write_file(repo / "blobs/info", R"({"default": {"features": {"text": {"dtype": "string"}}}})");
  test::write_file(repo / "refs/main", "4e5d\n");
  link_blob(repo, "4e5d", "data/train-00000-of-00002.parquet", "a1b2");
  link_blob(repo, "4e5d", "data/train-00001-of-00002.parquet", "c3d4");
  link_blob(repo, "4e5d", "data/validation-00000-of-00001.parquet", "e5f6");
  link_blob(repo, "4e5d", "README.md", "readme");
  link_blob(repo, "4e5d", "dataset_infos.json", "info");
  link_blob(repo, "0000", "data/train-00000-of-00001.parquet", "0ld0");  // an older revision
  fs::create_directories(repo / ".no_exist/4e5d");
  test::write_file(repo / ".no_exist/4e5d/other.json", "not data");

  auto files = data::list_data_files(repo, "train");
  EXPECT_EQ(names_of(files, repo / "snapshots/4e5d"),
            (std::vector<std::string>{"data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"}));
  DocumentReader r(files, "text");
  EXPECT_EQ(read_all(r), train);
  DocumentReader v(data::list_data_files(repo, "validation"), "text");
  EXPECT_EQ(read_all(v), validation);
  // A path inside the snapshot is a folder like any other; its files are links to follow.
  DocumentReader inside(data::list_data_files(repo / "snapshots/4e5d/data", "train"), "text");
  EXPECT_EQ(read_all(inside), train);
  // The data loader reads the train split, as the JSON Lines of the same documents.
  test::write_file(dir / "train.jsonl", test::jsonl(train));
  expect_same(take(*data::make_dataloader(config(repo, 2, 11), tok), 30),
              take(*data::make_dataloader(config(dir / "train.jsonl", 2, 11), tok), 30), "hub cache");
  // Without refs/main: the only snapshot, or an error naming the snapshots when there are several.
  fs::remove(repo / "refs/main");
  std::string msg = test::error_of([&] { data::list_data_files(repo, "train"); });
  EXPECT_NE(msg.find("0000, 4e5d"), std::string::npos) << msg;
  fs::remove_all(repo / "snapshots/0000");
  EXPECT_EQ(data::list_data_files(repo, "train"), files);
  // refs/main naming a missing snapshot.
  test::write_file(repo / "refs/main", "ffff");
  msg = test::error_of([&] { data::list_data_files(repo, "train"); });
  EXPECT_NE(msg.find("snapshots/ffff"), std::string::npos) << msg;
}

// A repository whose README.md declares configurations (as HuggingFaceFW/fineweb-edu does: the full
// data/ and sample/ subsets of the same documents): the default configuration's files of the split,
// by its patterns, not every file of the folder; of the configurations whose files are there.
TEST(DataHuggingFace, ReadmeConfigurationsNarrowTheFilesToTheDefaultOne) {
  test::TempDir dir;
  const fs::path repo = dir / "fineweb-edu";
  auto make = [&](const std::vector<std::string>& files) {
    fs::remove_all(repo);
    for (const std::string& f : files) {
      fs::create_directories((repo / f).parent_path());
      test::write_file(repo / f, test::jsonl({f}));
    }
  };
  const std::vector<std::string> all = {"data/CC-MAIN-2024-10/000_00000.jsonl", "data/CC-MAIN-2024-10/001_00000.jsonl",
                                        "data/CC-MAIN-2023-50/000_00000.jsonl", "sample/10BT/000_00000.jsonl",
                                        "sample/100BT/000_00000.jsonl", "eval/test-0.jsonl", "data/notes.jsonl"};
  make(all);
  const std::string front = R"(
---
license: odc-by
task_categories:
- text-generation
configs:
- config_name: default   # the whole crawl
  data_files:
  - split: train
    path: data/*/*
  - split: validation
    path:
    - "eval/test-*"
- config_name: sample-10BT
  description: |
    A sample: 10 billion tokens
    of the same documents.
  data_files:
  - split: train
    path: sample/10BT/*
-   config_name: 'sample-100BT'
    data_files: [
      "sample/100BT/*"]
- config_name: broken
  data_files: *an_alias
dataset_info:
  features:
  - name: text
    dtype: string
---
# FineWeb-Edu
)";
  test::write_file(repo / "README.md", front);
  EXPECT_EQ(names_of(data::list_data_files(repo, "train"), repo),
            (std::vector<std::string>{"data/CC-MAIN-2023-50/000_00000.jsonl", "data/CC-MAIN-2024-10/000_00000.jsonl",
                                      "data/CC-MAIN-2024-10/001_00000.jsonl"}));
  EXPECT_EQ(names_of(data::list_data_files(repo, "validation"), repo), (std::vector<std::string>{"eval/test-0.jsonl"}));
  // The configurations as read, the parser's forms included; the one it cannot read carries its problem.
  const auto configs = data::read_hub_configs(repo / "README.md");
  ASSERT_EQ(configs.size(), 4u);
  EXPECT_EQ(configs[1].name, "sample-10BT");
  EXPECT_EQ(configs[1].files.at("train"), (std::vector<std::string>{"sample/10BT/*"}));
  EXPECT_EQ(configs[2].name, "sample-100BT");
  EXPECT_EQ(configs[2].files.at("train"), (std::vector<std::string>{"sample/100BT/*"}));
  EXPECT_EQ(configs[0].files.at("validation"), (std::vector<std::string>{"eval/test-*"}));
  EXPECT_EQ(configs[3].name, "broken");
  EXPECT_NE(configs[3].problem.find("README.md:24: configuration 'broken': "), std::string::npos) << configs[3].problem;
  // Marked default (yes, as YAML 1.1 reads it) wins over the one named "default".
  std::string marked = front;
  marked.replace(marked.find("  description: |"), 16, "  default: yes\n  description: |");
  test::write_file(repo / "README.md", marked);
  EXPECT_EQ(names_of(data::list_data_files(repo, "train"), repo), (std::vector<std::string>{"sample/10BT/000_00000.jsonl"}));
  const std::string msg_split = test::error_of([&] { data::list_data_files(repo, "validation"); });
  EXPECT_NE(msg_split.find("configuration 'sample-10BT' of its README.md has no validation split (it has train)"),
            std::string::npos) << msg_split;
  // Several configurations here and no default: an error naming them and a folder to read instead.
  std::string none = front;
  none.replace(none.find("config_name: default"), 20, "config_name: full");
  test::write_file(repo / "README.md", none);
  const std::string msg = test::error_of([&] { data::list_data_files(repo, "train"); });
  EXPECT_NE(msg.find("holds the files of 3 configurations its README.md declares, and none is the default: full "
                     "(data/*/*), sample-10BT (sample/10BT/*), sample-100BT (sample/100BT/*). Reading them all would "
                     "repeat documents"),
            std::string::npos) << msg;
  EXPECT_NE(msg.find("(e.g. " + (repo / "data").string() + ")"), std::string::npos) << msg;
  // Only one configuration downloaded (load_dataset(..., name="sample-10BT") keeps the README): that one.
  make({"sample/10BT/000_00000.jsonl"});
  test::write_file(repo / "README.md", front);
  EXPECT_EQ(names_of(data::list_data_files(repo, "train"), repo), (std::vector<std::string>{"sample/10BT/000_00000.jsonl"}));
  // The default configuration present for one split only: the other split's patterns match nothing.
  make({"data/a/0.jsonl"});
  test::write_file(repo / "README.md", front);
  const std::string missing = test::error_of([&] { data::list_data_files(repo, "validation"); });
  EXPECT_NE(missing.find("configuration 'default' of its README.md names eval/test-* for the validation split and no "
                         "data file here matches (an incomplete download?)"),
            std::string::npos) << missing;
  // A configuration by data_dir: its folder, split by file names.
  make({"v1/train-0.jsonl", "v1/validation-0.jsonl", "v2/train-0.jsonl"});
  test::write_file(repo / "README.md", "---\nconfigs:\n- config_name: v1\n  data_dir: v1\n  default: true\n"
                                       "- config_name: v2\n  data_dir: v2\n---\n");
  EXPECT_EQ(names_of(data::list_data_files(repo, "train"), repo), (std::vector<std::string>{"v1/train-0.jsonl"}));
  EXPECT_EQ(names_of(data::list_data_files(repo, "validation"), repo), (std::vector<std::string>{"v1/validation-0.jsonl"}));
  // No configuration of the README here, or none declared: the folder by the other rules.
  make({"a.jsonl", "b.jsonl"});
  test::write_file(repo / "README.md", front);
  EXPECT_EQ(data::list_data_files(repo, "train").size(), 2u);
  test::write_file(repo / "README.md", "---\nlicense: mit\n---\n");
  EXPECT_EQ(data::list_data_files(repo, "train").size(), 2u);
  // Patterns: '*' within a segment, '**' across segments.
  EXPECT_TRUE(data::hub_pattern_matches("data/*/*", "data/a/b.jsonl"));
  EXPECT_FALSE(data::hub_pattern_matches("data/*", "data/a/b.jsonl"));
  EXPECT_TRUE(data::hub_pattern_matches("data/**", "data/a/b/c.jsonl"));
  EXPECT_TRUE(data::hub_pattern_matches("**/*.jsonl", "x.jsonl"));
  EXPECT_TRUE(data::hub_pattern_matches("./en/c4-train.*.json.gz", "en/c4-train.00001-of-01024.json.gz"));
}

// README entries titan cannot read, or whose files load_dataset finds by its own rules: an error or
// the folder by the other rules where load_dataset would read that entry by default (marked default,
// named "default" or unnamed, or the only one), and passed over otherwise.
TEST(DataHuggingFace, EntriesTitanCannotReadAreErrorsWhereLoadDatasetWouldReadThem) {
  test::TempDir dir;
  const fs::path repo = dir / "repo";
  for (const std::string f : {"data/a/0.jsonl", "data/b/0.jsonl", "sample/0.jsonl"}) {
    fs::create_directories((repo / f).parent_path());
    test::write_file(repo / f, test::jsonl({f}));
  }
  const std::string readme = (repo / "README.md").string();
  auto with = [&](const std::string& configs) { test::write_file(readme, "---\nconfigs:\n" + configs + "---\n"); };
  auto files = [&] { return names_of(data::list_data_files(repo, "train"), repo); };
  auto error = [&] { return test::error_of([&] { data::list_data_files(repo, "train"); }); };
  const std::string tail = ". titan cannot read this entry, and load_dataset would read it by default: set the dataset "
                           "path to the folder or file of the data to read, or simplify the entry in README.md";
  const std::string sample = "- config_name: sample\n  data_files: sample/*\n";
  const std::vector<std::string> all = {"data/a/0.jsonl", "data/b/0.jsonl", "sample/0.jsonl"};

  // An empty (or blank, or list) config_name: the entry is unnamed, and as the only one, an error.
  for (const std::string name : {"''", "'  '", "[a]"}) {
    with("- config_name: " + name + "\n  data_files: data/*/*\n");
    const auto configs = data::read_hub_configs(readme);
    ASSERT_EQ(configs.size(), 1u);
    EXPECT_EQ(configs[0].name, "default") << name;
    EXPECT_EQ(configs[0].problem, readme + ":3: a configuration: its config_name is empty or not a plain name: name it")
        << name;
    EXPECT_EQ(error(), configs[0].problem + tail) << name;
  }
  // Named default and unreadable (an alias), beside a readable one: the error, naming it.
  with("- config_name: default\n  data_files: *files\n" + sample);
  EXPECT_EQ(error(), readme + ":3: configuration 'default': line 4: unsupported YAML value '*files' (anchors, aliases and "
                              "tags)" + tail);
  // In a flow mapping, and with a quoted key: the names as written.
  with("- {config_name: default, data_files: *files}\n" + sample);
  EXPECT_NE(error().find("configuration 'default':"), std::string::npos) << error();
  with("- \"config_name\": en\n  data_files: *files\n" + sample);
  EXPECT_EQ(data::read_hub_configs(readme).at(0).name, "en");
  EXPECT_EQ(files(), std::vector<std::string>{"sample/0.jsonl"});  // en is neither marked nor named default
  // Marked default under another name (its mark found in the text): the error, not the readable one.
  with("- config_name: main\n  default: true\n  data_files: *files\n" + sample);
  EXPECT_NE(error().find("configuration 'main':"), std::string::npos) << error();
  // The only entry, under another name: the error, not the whole folder.
  with("- config_name: en\n  data_files: *files\n");
  EXPECT_NE(error().find("configuration 'en':"), std::string::npos) << error();
  // A readable one marked default wins over any unreadable entry.
  with("- config_name: default\n  data_files: *files\n- config_name: sample\n  default: true\n  data_files: sample/*\n");
  EXPECT_EQ(files(), std::vector<std::string>{"sample/0.jsonl"});
  // Without data_files nor data_dir (load_dataset then finds the files itself): as the default, the
  // folder by the other rules; otherwise passed over.
  with("- config_name: default\n  drop_labels: true\n" + sample);
  EXPECT_EQ(files(), all);
  with("- config_name: other\n  drop_labels: true\n" + sample);
  EXPECT_EQ(files(), std::vector<std::string>{"sample/0.jsonl"});
}

// allenai/c4's layout with several variants downloaded: each configuration's files lie in a folder of
// its own, so only the chosen one's folder (en/) is listed whole; the others are looked into up to
// their first file. Shown by a link to a missing file in a variant not read: listed whole (as without
// the README), it is an error.
TEST(DataHuggingFace, OnlyTheChosenConfigurationsFolderIsListed) {
  test::TempDir dir;
  const fs::path repo = dir / "c4";
  for (const std::string f : {"en/c4-train.00000-of-00002.jsonl", "en/c4-train.00001-of-00002.jsonl",
                              "en/c4-validation.00000-of-00001.jsonl", "en.noclean/c4-train.00000-of-00002.jsonl",
                              "realnewslike/c4-train.00000-of-00001.jsonl"}) {
    fs::create_directories((repo / f).parent_path());
    test::write_file(repo / f, test::jsonl({f}));
  }
  fs::create_symlink(dir / "missing-blob", repo / "en.noclean/c4-train.00001-of-00002.jsonl");
  auto full_listing = [&] { return test::error_of([&] { data::list_data_files(repo, "train"); }); };
  EXPECT_NE(full_listing().find("c4-train.00001-of-00002.jsonl' is a link to a missing file"), std::string::npos)
      << full_listing();
  const std::string configs = R"(configs:
- config_name: en
  data_files:
  - split: train
    path: en/c4-train.*.jsonl
  - split: validation
    path: en/c4-validation.*.jsonl
- config_name: en.noclean
  data_files:
  - split: train
    path: en.noclean/c4-train.*.jsonl
- config_name: realnewslike
  data_files:
  - split: train
    path: realnewslike/c4-train.*.jsonl
)";
  test::write_file(repo / "README.md", "---\n" + configs + "---\n");
  EXPECT_EQ(names_of(data::list_data_files(repo, "train"), repo),
            (std::vector<std::string>{"en/c4-train.00000-of-00002.jsonl", "en/c4-train.00001-of-00002.jsonl"}));
  EXPECT_EQ(names_of(data::list_data_files(repo, "validation"), repo),
            (std::vector<std::string>{"en/c4-validation.00000-of-00001.jsonl"}));
  // A configuration at the repository's top level ("*.jsonl") needs the whole listing again.
  test::write_file(repo / "README.md", "---\n" + configs + "- config_name: top\n  data_files: \"*.jsonl\"\n---\n");
  EXPECT_NE(full_listing().find("is a link to a missing file"), std::string::npos) << full_listing();
}

// A Hub cache's snapshots/ folder (one folder per revision) is refused: reading every revision would
// repeat documents.
TEST(DataHuggingFace, TheSnapshotsFolderOfACacheIsRefused) {
  test::TempDir dir;
  const fs::path repo = dir / "datasets--org--name";
  fs::create_directories(repo / "refs");
  for (const std::string rev : {"aaaa", "bbbb"}) {
    fs::create_directories(repo / "snapshots" / rev);
    test::write_file(repo / "snapshots" / rev / "train.jsonl", test::jsonl({rev}));
  }
  const std::string msg = test::error_of([&] { data::list_data_files(repo / "snapshots", "train"); });
  EXPECT_NE(msg.find("is the snapshots/ folder of a Hugging Face cache, one folder per revision"), std::string::npos) << msg;
}

TEST(DataHuggingFace, AllenaiC4AsTorchtitanLoadsIt) {
  // torchtitan's c4: load_dataset("allenai/c4", name="en") caches datasets--allenai--c4 with
  // snapshots/<rev>/en/c4-train.*.json.gz and c4-validation.*.json.gz.
  test::TempDir dir;
  test::ByteTokenizer tok;
  const auto train = table_docs(25), validation = table_docs(7, 50);
  const fs::path repo = dir / "datasets--allenai--c4";
  fs::create_directories(repo / "blobs");
  fs::create_directories(repo / "refs");
  test::write_gzip(repo / "blobs/t0", {test::jsonl({train.begin(), train.begin() + 12})});
  test::write_gzip(repo / "blobs/t1", {test::jsonl({train.begin() + 12, train.end()})});
  test::write_gzip(repo / "blobs/v0", {test::jsonl(validation)});
  test::write_file(repo / "refs/main", "1588ec4");
  link_blob(repo, "1588ec4", "en/c4-train.00000-of-01024.json.gz", "t0");
  link_blob(repo, "1588ec4", "en/c4-train.00001-of-01024.json.gz", "t1");
  link_blob(repo, "1588ec4", "en/c4-validation.00000-of-00008.json.gz", "v0");
  test::write_file(dir / "train.jsonl", test::jsonl(train));
  test::write_file(dir / "validation.jsonl", test::jsonl(validation));
  auto r = data::resolve_dataset("c4", repo, "training");
  EXPECT_EQ(r.kind, "text");
  EXPECT_EQ(data::list_data_files(r.path, r.split).size(), 2u);
  expect_same(take(*data::make_dataloader(config(repo, 2, 11), tok), 20),
              take(*data::make_dataloader(config(dir / "train.jsonl", 2, 11), tok), 20), "c4 train");
  data::DataConfig v = config(repo, 2, 11);
  v.dataset = "c4_validation";
  expect_same(take(*data::make_dataloader(v, tok), 10),
              take(*data::make_dataloader(config(dir / "validation.jsonl", 2, 11), tok), 10), "c4 validation");
}

TEST(DataHuggingFace, SaveToDiskAndCacheFoldersBySplitWithoutTheirMetadata) {
  test::TempDir dir;
  const auto train = table_docs(20), validation = table_docs(6, 70), test_split = table_docs(4, 90);
  test::write_file(dir / "train.jsonl", test::jsonl(train));
  test::write_file(dir / "validation.jsonl", test::jsonl(validation));
  write_tables(dir, json::array({
                        {{"kind", "dataset-dict"}, {"out", dir / "dict"},
                         {"splits", {{"train", train}, {"validation", validation}, {"test", test_split}}},
                         {"num_shards", {{"train", 3}, {"validation", 1}, {"test", 1}}}},
                        {{"kind", "save-to-disk"}, {"out", dir / "single"}, {"docs", train}, {"num_shards", 2}},
                        {{"kind", "load-json"}, {"out", dir / "cache"},
                         {"data_files", {{"train", dir / "train.jsonl"}, {"validation", dir / "validation.jsonl"}}}},
                    }));
  auto read = [&](const std::string& path, const std::string& split) {
    DocumentReader r(data::list_data_files(path, split), "text");
    return read_all(r);
  };
  // save_to_disk of a DatasetDict: dataset_dict.json, and per split data-*.arrow, state.json, dataset_info.json.
  EXPECT_EQ(names_of(data::list_data_files(dir / "dict", "train"), dir / "dict"),
            (std::vector<std::string>{"train/data-00000-of-00003.arrow", "train/data-00001-of-00003.arrow",
                                      "train/data-00002-of-00003.arrow"}));
  EXPECT_EQ(read(dir / "dict", "train"), train);
  EXPECT_EQ(read(dir / "dict", "validation"), validation);
  EXPECT_EQ(read(dir / "dict/test", "train"), test_split);  // a split's own folder: no file of "train", all read
  // A single-split save_to_disk folder: its data files, not its metadata.
  EXPECT_EQ(names_of(data::list_data_files(dir / "single", "train"), dir / "single"),
            (std::vector<std::string>{"data-00000-of-00002.arrow", "data-00001-of-00002.arrow"}));
  EXPECT_EQ(read(dir / "single", "validation"), train);
  // The cache of load_dataset("json", ...): .../json/default-*/0.0.0/<hash>/json-train.arrow.
  auto cached = data::list_data_files(dir / "cache", "train");
  ASSERT_EQ(cached.size(), 1u);
  EXPECT_EQ(fs::path(cached[0]).filename(), "json-train.arrow");
  EXPECT_EQ(read(dir / "cache", "train"), train);
  EXPECT_EQ(read(dir / "cache", "validation"), validation);
}

TEST(DataHuggingFace, SplitRuleNarrowsOnlyWhenTheSplitHasFiles) {
  test::TempDir dir;
  for (const char* name : {"train.jsonl", "trainer.jsonl", "train_extra/a.jsonl", "train7.jsonl", "x/train/0.jsonl",
                           "mydata-train-00000-of-00002.jsonl", "mydata-train.jsonl", "validation.0.jsonl",
                           "validation/a.jsonl", "other-validation-1.jsonl", "constrain/b.jsonl", "dataset_info.json",
                           "sub/state.json", "dataset_dict.json", "dataset_infos.json", ".hidden/c.jsonl", ".d.jsonl"}) {
    fs::create_directories((fs::path(dir.path()) / name).parent_path());
    test::write_file(dir / name, "{\"text\": \"x\"}\n");
  }
  EXPECT_EQ(names_of(data::list_data_files(dir.path(), "train"), dir.path()),
            (std::vector<std::string>{"mydata-train-00000-of-00002.jsonl", "mydata-train.jsonl", "train.jsonl",
                                      "train7.jsonl", "train_extra/a.jsonl", "x/train/0.jsonl"}));
  EXPECT_EQ(names_of(data::list_data_files(dir.path(), "validation"), dir.path()),
            (std::vector<std::string>{"other-validation-1.jsonl", "validation.0.jsonl", "validation/a.jsonl"}));
  // No file of the split: every data file (never the metadata).
  test::TempDir flat;
  for (const char* name : {"a.jsonl", "b/c.parquet", "state.json", "d.arrow"}) {
    fs::create_directories((fs::path(flat.path()) / name).parent_path());
    test::write_file(flat / name, "");
  }
  EXPECT_EQ(names_of(data::list_data_files(flat.path(), "validation"), flat.path()),
            (std::vector<std::string>{"a.jsonl", "b/c.parquet", "d.arrow"}));
  // Files of other splits only: refused, not read in place of the split asked for (validating on the
  // training data). The validation split's other names (the Pile's val.jsonl.zst, dev sets) count.
  test::TempDir other;
  for (const char* name : {"train/a.jsonl", "test/b.jsonl"}) {
    fs::create_directories((fs::path(other.path()) / name).parent_path());
    test::write_file(other / name, "{\"text\": \"x\"}\n");
  }
  std::string refused = test::error_of([&] { data::list_data_files(other.path(), "validation"); });
  EXPECT_NE(refused.find("holds files of the test and train split(s) but none of the validation split (files or "
                         "folders named validation, valid, val or dev)"),
            std::string::npos) << refused;
  test::write_file(other / "val.jsonl", "{\"text\": \"v\"}\n");
  EXPECT_EQ(names_of(data::list_data_files(other.path(), "validation"), other.path()),
            (std::vector<std::string>{"val.jsonl"}));
  // A folder of metadata only holds no data.
  test::TempDir meta;
  test::write_file(meta / "dataset_info.json", "{}");
  const std::string msg = test::error_of([&] { data::list_data_files(meta.path()); });
  EXPECT_NE(msg.find("holds no data file"), std::string::npos) << msg;
  EXPECT_NE(msg.find(".parquet"), std::string::npos) << msg;
}

// Links: a folder reached again through a link (here its own parent) is read once; a data file whose
// link points at a missing blob is an error, not data dropped without a word.
TEST(DataHuggingFace, LinkedFoldersAreReadOnceAndBrokenLinksAreErrors) {
  test::TempDir dir;
  fs::create_directories(fs::path(dir.path()) / "data");
  test::write_file(dir / "data/a.jsonl", "{\"text\": \"x\"}\n");
  fs::create_directory_symlink(fs::path(dir.path()), fs::path(dir.path()) / "data/loop");
  EXPECT_EQ(names_of(data::list_data_files(dir.path(), "train"), dir.path()), (std::vector<std::string>{"data/a.jsonl"}));
  fs::create_symlink(fs::path(dir.path()) / "blobs/gone", fs::path(dir.path()) / "data/b.parquet");
  const std::string msg = test::error_of([&] { data::list_data_files(dir.path(), "train"); });
  EXPECT_NE(msg.find("b.parquet' is a link to a missing file"), std::string::npos) << msg;
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The error of reading every document of `path` (a UserError, never a crash), "" when none.
std::string error_reading(const std::string& path, const std::string& column = "text") {
  return test::error_of([&] {
    DocumentReader r({path}, column);
    read_all(r);
  });
}

TEST(DataTables, DamagedFilesAreClearErrors) {
  test::TempDir dir;
  auto docs = table_docs(30);
  json with_null = docs;
  with_null[9] = nullptr;
  const std::string out = write_tables(dir, json::array({
      // Without statistics, which would fill the middle of a data page's header with a min and a max.
      {{"kind", "parquet"}, {"out", dir / "plain.parquet"}, {"docs", docs}, {"compression", "none"}, {"dictionary", false},
       {"statistics", false}},
      {{"kind", "parquet"}, {"out", dir / "snappy.parquet"}, {"docs", docs}, {"statistics", false}},
      {{"kind", "parquet"}, {"out", dir / "crc.parquet"}, {"docs", docs}, {"compression", "none"}, {"dictionary", false},
       {"statistics", false}, {"checksums", true}},
      {{"kind", "arrow-stream"}, {"out", dir / "stream.arrow"}, {"docs", docs}},
      {{"kind", "arrow-file"}, {"out", dir / "file.arrow"}, {"docs", docs}},
      {{"kind", "parquet"}, {"out", dir / "null.parquet"}, {"docs", with_null}},
      {{"kind", "arrow-stream"}, {"out", dir / "null.arrow"}, {"docs", with_null}},
  }));
  std::vector<json> pages;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);)
    if (!line.empty() && line[0] == '{') pages.push_back(json::parse(line));
  ASSERT_EQ(pages.size(), 4u) << out;

  auto expect_error = [&](const std::string& path, const std::string& part, const std::string& column = "text") {
    const std::string msg = error_reading(path, column);
    EXPECT_NE(msg.find(path), std::string::npos) << path << ": " << msg;
    EXPECT_NE(msg.find(part), std::string::npos) << path << ": " << msg;
  };
  // Truncated: Parquet loses its footer, an IPC file its footer, an IPC stream a message body.
  for (const std::string name : {"plain.parquet", "stream.arrow", "file.arrow"}) {
    const std::string bytes = read_bytes(dir / name);
    test::write_file(dir / ("cut_" + name), bytes.substr(0, bytes.size() / 2 + 3));
    expect_error(dir / ("cut_" + name), "damaged or truncated");
  }
  // An IPC stream cut exactly after a batch (its end-of-stream marker gone) would read as a complete,
  // shorter stream: the missing marker tells.
  {
    const std::string bytes = read_bytes(dir / "stream.arrow");
    ASSERT_EQ(bytes.substr(bytes.size() - 8), std::string("\xff\xff\xff\xff\0\0\0\0", 8));
    test::write_file(dir / "no_eos.arrow", bytes.substr(0, bytes.size() - 8));
    expect_error(dir / "no_eos.arrow", "end-of-stream marker");
  }
  // Bytes flipped in the middle of the first row group's data page, uncompressed and compressed, and
  // in a page with a checksum to ASCII letters (which only the checksum tells from text).
  for (auto [name, page, to] : {std::tuple{"plain.parquet", pages[0], '\xff'}, std::tuple{"snappy.parquet", pages[1], '\xff'},
                                std::tuple{"crc.parquet", pages[2], 'X'}}) {
    std::string bytes = read_bytes(dir / name);
    const size_t mid = page.at("page_offset").get<size_t>() + page.at("page_bytes").get<size_t>() / 2;
    for (size_t i = mid; i < mid + 6; ++i) bytes[i] = to;
    test::write_file(dir / (std::string("flipped_") + name), bytes);
    expect_error(dir / (std::string("flipped_") + name), "damaged");
  }
  // An Arrow IPC stream with bytes flipped in the middle (in its text data: invalid UTF-8).
  {
    std::string bytes = read_bytes(dir / "stream.arrow");
    const size_t at = bytes.rfind("doc14:");  // the batch of rows 14..20 (before it: batch 7..13's unused tail)
    ASSERT_NE(at, std::string::npos);
    for (size_t i = at; i < at + 4; ++i) bytes[i] = static_cast<char>(0xff);
    test::write_file(dir / "flipped.arrow", bytes);
    expect_error(dir / "flipped.arrow", "UTF8");
  }
  // Not a Parquet file at all.
  test::write_file(dir / "text.parquet", test::jsonl(docs));
  expect_error(dir / "text.parquet", "not a Parquet file");
  test::write_file(dir / "text.arrow", test::jsonl(docs));
  expect_error(dir / "text.arrow", "damaged");
  // A missing column lists the columns; a column of numbers is not text.
  for (const std::string name : {"plain.parquet", "stream.arrow", "file.arrow"}) {
    expect_error(dir / name, "no column 'content' (columns: id (int64), text (string))", "content");
    expect_error(dir / name, "column 'id' is int64, expected a string column", "id");
  }
  // A null text names its row.
  expect_error(dir / "null.parquet", "row 9 (counting from 0): the text column 'text' is null");
  expect_error(dir / "null.arrow", "row 9 (counting from 0): the text column 'text' is null");
  // The rows before the null one are served.
  DocumentReader r({dir / "null.parquet"}, "text");
  std::string text;
  DocPos pos;
  for (int i = 0; i < 9; ++i) ASSERT_TRUE(r.next(text, pos));
  EXPECT_EQ(text, docs[8]);
}

// `titan tokenize` on Parquet and Arrow data writes the shards of the same documents in JSON Lines.
TEST(TitanTokenize, ParquetAndArrowGiveTheShardsOfJsonLines) {
  test::TempDir dir;
  std::vector<std::string> all;
  json specs = json::array();
  fs::create_directories(dir / "text");
  fs::create_directories(dir / "parquet");
  for (int f = 0; f < 3; ++f) {
    std::vector<std::string> docs;
    for (int d = 0; d < 200; ++d) {
      std::string doc;
      for (int w = 0; w < 10 + (d * 13 + f) % 60; ++w) doc += "word" + std::to_string((w * 31 + d * 7 + f) % 97) + " ";
      docs.push_back(doc);
    }
    test::write_file(dir / ("text/part" + std::to_string(f) + ".jsonl"), test::jsonl(docs));
    specs.push_back({{"kind", "parquet"}, {"out", dir / ("parquet/part" + std::to_string(f) + ".parquet")},
                     {"docs", docs}, {"row_group_size", 64}});
    all.insert(all.end(), docs.begin(), docs.end());
  }
  specs.push_back({{"kind", "save-to-disk"}, {"out", dir / "saved"}, {"docs", all}, {"num_shards", 2}});
  write_tables(dir, specs);
  auto tokenize = [&](const std::string& input, const std::string& out) {
    auto r = test::run_process({kTitan, "tokenize", "--output", dir / out, "--workers", "2", "--training.dataset", "c4",
                                "--training.dataset_path", input, "--model.hf_assets_path",
                                std::string(TITAN_SOURCE_DIR) + "/assets/tokenizer"});
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("tokenized 600 documents"), std::string::npos) << r.output;
    std::map<std::string, std::string> files;
    for (const auto& e : fs::directory_iterator(dir / out))
      if (e.path().filename() != "manifest.json") files[e.path().filename().string()] = read_bytes(e.path());
    json m = json::parse(read_bytes(dir / (out + "/manifest.json")));
    m.erase("sources");
    files["manifest without sources"] = m.dump();
    return files;
  };
  const auto text = tokenize(dir / "text", "from_text");
  ASSERT_GT(text.size(), 1u);
  EXPECT_EQ(tokenize(dir / "parquet", "from_parquet"), text);
  EXPECT_EQ(tokenize(dir / "saved", "from_arrow"), text);
}

}  // namespace
}  // namespace titan
