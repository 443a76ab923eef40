#include "titan/components/data/token_shards.h"

#include "titan/common/error.h"
#include "titan/common/plain_name.h"
#include "titan/common/json_integer.h"
#include "titan/components/data/jsonl_reader.h"

#include <algorithm>
#include <bit>
#include <optional>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace titan::data {
namespace fs = std::filesystem;

namespace {

constexpr char kMagic[8] = {'T', 'I', 'T', 'A', 'N', 'T', 'O', 'K'};
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 64;
constexpr const char* kFormat = "titan-token-shards";

struct Header {  // the first 40 bytes of a shard; the rest of the 64 are zero
  char magic[8];
  uint32_t version;
  uint32_t token_bytes;
  uint64_t num_tokens;
  uint64_t num_documents;
  uint64_t vocab_size;
};
static_assert(sizeof(Header) == 40);
static_assert(std::endian::native == std::endian::little, "the shard format is little-endian");

size_t doc_index_offset(uint64_t num_tokens) { return (kHeaderBytes + 4 * num_tokens + 7) / 8 * 8; }

std::string shard_name(int64_t i) {
  char name[32];
  std::snprintf(name, sizeof(name), "shard-%05lld.bin", static_cast<long long>(i));
  return name;
}

nlohmann::json optional_id(std::optional<int32_t> id) { return id ? nlohmann::json(*id) : nlohmann::json(nullptr); }

// Writes one shard: header placeholder, tokens as they come, then the document index and the header.
class ShardFile {
 public:
  ShardFile(const std::string& path, uint64_t vocab_size) : path_(path), vocab_size_(vocab_size) {
    out_.open(path, std::ios::binary | std::ios::trunc);
    TITAN_USER_CHECK(out_.good(), "cannot write token shard '", path, "'");
    char zeros[kHeaderBytes] = {};
    out_.write(zeros, kHeaderBytes);
  }
  void add_document(const std::vector<int32_t>& ids) {
    doc_starts_.push_back(num_tokens_);
    tmp_.assign(ids.begin(), ids.end());
    out_.write(reinterpret_cast<const char*>(tmp_.data()), static_cast<std::streamsize>(4 * tmp_.size()));
    num_tokens_ += ids.size();
  }
  uint64_t num_tokens() const { return num_tokens_; }
  uint64_t num_documents() const { return doc_starts_.size(); }
  void close() {
    size_t end = kHeaderBytes + 4 * num_tokens_;
    char zeros[8] = {};
    out_.write(zeros, static_cast<std::streamsize>(doc_index_offset(num_tokens_) - end));
    out_.write(reinterpret_cast<const char*>(doc_starts_.data()), static_cast<std::streamsize>(8 * doc_starts_.size()));
    Header h{};
    std::memcpy(h.magic, kMagic, 8);
    h.version = kVersion;
    h.token_bytes = 4;
    h.num_tokens = num_tokens_;
    h.num_documents = doc_starts_.size();
    h.vocab_size = vocab_size_;
    out_.seekp(0);
    out_.write(reinterpret_cast<const char*>(&h), sizeof(h));
    out_.close();
    TITAN_USER_CHECK(!out_.fail(), "writing token shard '", path_, "' failed (disk full?)");
  }

 private:
  std::string path_;
  uint64_t vocab_size_;
  std::ofstream out_;
  uint64_t num_tokens_ = 0;
  std::vector<uint64_t> doc_starts_;
  std::vector<uint32_t> tmp_;
};

}  // namespace

bool is_shard_folder(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::is_regular_file(fs::path(path) / "manifest.json", ec);
}

ShardWriteResult tokenize_to_shards(const std::string& input_path, const Tokenizer& tokenizer, const std::string& out_dir,
                                    const ShardWriteOptions& options) {
  TITAN_USER_CHECK(options.tokens_per_shard >= 1, "tokens_per_shard must be positive");
  std::error_code ec;
  if (fs::exists(out_dir, ec)) {
    TITAN_USER_CHECK(fs::is_directory(out_dir, ec) && fs::is_empty(out_dir, ec), "output folder '", out_dir,
                     "' exists and is not empty: remove it or choose another");
  }
  fs::create_directories(out_dir, ec);
  TITAN_USER_CHECK(!ec, "cannot create output folder '", out_dir, "': ", ec.message());

  std::vector<std::string> files = list_data_files(input_path, options.split);
  JsonlReader reader(files, options.text_field);
  reader.rewind(0);
  const int64_t vocab = tokenizer.vocab_size();

  ShardWriteResult result;
  nlohmann::json shards = nlohmann::json::array();
  std::unique_ptr<ShardFile> shard;
  auto close_shard = [&] {
    shard->close();
    shards.push_back({{"file", shard_name(result.num_shards)},
                      {"num_tokens", shard->num_tokens()},
                      {"num_documents", shard->num_documents()}});
    ++result.num_shards;
    shard.reset();
  };
  std::string text;
  DocPos pos;
  while (reader.next(text, pos)) {
    std::vector<int32_t> ids = tokenizer.encode(text, /*add_bos=*/true, /*add_eos=*/true);
    for (int32_t id : ids) TITAN_ASSERT(id >= 0 && id < vocab, "token id ", id, " outside the vocabulary of ", vocab);
    if (!shard) shard = std::make_unique<ShardFile>((fs::path(out_dir) / shard_name(result.num_shards)).string(), vocab);
    shard->add_document(ids);
    ++result.num_documents;
    result.num_tokens += static_cast<int64_t>(ids.size());
    if (static_cast<int64_t>(shard->num_tokens()) >= options.tokens_per_shard) close_shard();
  }
  if (shard) close_shard();
  TITAN_USER_CHECK(result.num_tokens > 0, "'", input_path, "' yields no tokens: nothing to write");

  nlohmann::json manifest = {
      {"format", kFormat},
      {"version", kVersion},
      {"num_tokens", result.num_tokens},
      {"num_documents", result.num_documents},
      {"tokenizer",
       {{"vocab_size", vocab}, {"bos_id", optional_id(tokenizer.bos_id())}, {"eos_id", optional_id(tokenizer.eos_id())},
        {"name", options.tokenizer_name}}},
      {"text_field", options.text_field},
      {"sources", files},
      {"shards", shards}};
  std::string tmp = (fs::path(out_dir) / "manifest.json.tmp").string();
  {
    std::ofstream out(tmp);
    out << manifest.dump(2) << "\n";
    TITAN_USER_CHECK(out.good(), "cannot write '", tmp, "'");
  }
  fs::rename(tmp, fs::path(out_dir) / "manifest.json");
  return result;
}

// ---------------------------------------------------------------------------------------------

ShardWindowSource::ShardWindowSource(const std::string& dir, const Tokenizer& tokenizer, int64_t seq_len)
    : MappedTokenSource("shards", "token shard", seq_len, tokenizer.vocab_size()) {
  const std::string manifest_path = (fs::path(dir) / "manifest.json").string();
  nlohmann::json m;
  {
    std::ifstream in(manifest_path);
    TITAN_USER_CHECK(in.good(), "no token shard manifest '", manifest_path, "': write the folder with `titan tokenize`");
    try {
      m = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      TITAN_USER_CHECK(false, "'", manifest_path, "' is not valid JSON: ", e.what());
    }
  }
  try {
    TITAN_USER_CHECK(m.at("format") == kFormat && m.at("version") == kVersion, "'", manifest_path,
                     "' is not a version-", kVersion, " titan token shard manifest");
    const auto& t = m.at("tokenizer");
    TITAN_USER_CHECK(json_integer<int64_t>(t.at("vocab_size")) == tokenizer.vocab_size() &&
                         t.at("bos_id") == optional_id(tokenizer.bos_id()) && t.at("eos_id") == optional_id(tokenizer.eos_id()),
                     "the token shards in '", dir, "' were written with another tokenizer (vocab_size ", t.at("vocab_size"),
                     ", bos ", t.at("bos_id"), ", eos ", t.at("eos_id"), "; this one: vocab_size ", tokenizer.vocab_size(),
                     "): re-run `titan tokenize` with the model's tokenizer");
    for (const auto& s : m.at("shards")) {
      const std::string path =
          (fs::path(dir) / plain_file_name(s.at("file").get<std::string>(), "token shard manifest '" + manifest_path + "'"))
              .string();
      const uint64_t n = json_integer<uint64_t>(s.at("num_tokens"));
      const uint64_t docs = json_integer<uint64_t>(s.at("num_documents"));
      const Mapped map = map_file(path);
      const size_t bytes = map.bytes;
      // The manifest's counts are compared with the file's size before any arithmetic on them could overflow.
      TITAN_USER_CHECK(n <= bytes / 4 && docs <= bytes / 8 && doc_index_offset(n) + 8 * docs <= bytes, "token shard '",
                       path, "' has ", bytes, " bytes, too few for the ", n, " tokens and ", docs,
                       " documents of its manifest entry (truncated?)");
      Header h;
      std::memcpy(&h, map.data, sizeof(h));
      TITAN_USER_CHECK(std::memcmp(h.magic, kMagic, 8) == 0 && h.version == kVersion && h.token_bytes == 4 &&
                           h.num_tokens == n,
                       "token shard '", path, "' does not match its manifest entry (bad header)");
      add_segment(path, map.data + kHeaderBytes, TokenType::U32, static_cast<int64_t>(n));
    }
    TITAN_USER_CHECK(num_tokens() == json_integer<int64_t>(m.at("num_tokens")) && num_tokens() > 0, "the token shards in '",
                     dir, "' hold ", num_tokens(), " tokens, the manifest says ", m.at("num_tokens"));
  } catch (const nlohmann::json::exception& e) {
    TITAN_USER_CHECK(false, "'", manifest_path, "' lacks a field or has a wrong type: ", e.what());
  }
}

}  // namespace titan::data
