#include "titan/components/data/token_shards.h"

#include "titan/common/error.h"
#include "titan/common/plain_name.h"
#include "titan/common/json_integer.h"
#include "titan/components/data/jsonl_reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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
    : window_len_(seq_len + 1), vocab_size_(static_cast<uint64_t>(tokenizer.vocab_size())) {
  TITAN_USER_CHECK(seq_len >= 1, "seq_len must be at least 1, got ", seq_len);
  // A bad folder throws below, and a constructor that throws runs no destructor: unmap here.
  struct UnmapOnThrow {
    std::vector<Shard>& shards;
    bool armed = true;
    ~UnmapOnThrow() {
      if (armed)
        for (auto& s : shards) ::munmap(s.map, s.map_bytes);
    }
  } unmap_on_throw{shards_};
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
      const uint64_t docs = json_integer<uint64_t>(s.at("num_documents"));  // before open(): this may throw
      int fd = ::open(path.c_str(), O_RDONLY);
      TITAN_USER_CHECK(fd >= 0, "cannot open token shard '", path, "': ", std::strerror(errno));
      struct stat st {};
      ::fstat(fd, &st);
      const size_t bytes = static_cast<size_t>(st.st_size);
      // The manifest's counts are compared with the file's size before any arithmetic on them could overflow.
      const bool fits = n <= bytes / 4 && docs <= bytes / 8 && doc_index_offset(n) + 8 * docs <= bytes;
      if (!fits) ::close(fd);
      TITAN_USER_CHECK(fits, "token shard '", path, "' has ", bytes, " bytes, too few for the ", n, " tokens and ", docs,
                       " documents of its manifest entry (truncated?)");
      void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
      ::close(fd);
      TITAN_USER_CHECK(map != MAP_FAILED, "cannot map token shard '", path, "': ", std::strerror(errno));
      Shard shard{map, bytes, reinterpret_cast<const uint32_t*>(static_cast<const char*>(map) + kHeaderBytes),
                  static_cast<int64_t>(n), total_tokens_, path};
      shards_.push_back(shard);  // owned from here on: unmapped by the destructor
      Header h;
      std::memcpy(&h, map, sizeof(h));
      TITAN_USER_CHECK(std::memcmp(h.magic, kMagic, 8) == 0 && h.version == kVersion && h.token_bytes == 4 &&
                           h.num_tokens == n,
                       "token shard '", path, "' does not match its manifest entry (bad header)");
      total_tokens_ += static_cast<int64_t>(n);
    }
    TITAN_USER_CHECK(total_tokens_ == json_integer<int64_t>(m.at("num_tokens")) && total_tokens_ > 0, "the token shards in '", dir,
                     "' hold ", total_tokens_, " tokens, the manifest says ", m.at("num_tokens"));
  } catch (const nlohmann::json::exception& e) {
    TITAN_USER_CHECK(false, "'", manifest_path, "' lacks a field or has a wrong type: ", e.what());
  }
  unmap_on_throw.armed = false;
}

ShardWindowSource::~ShardWindowSource() {
  for (auto& s : shards_) ::munmap(s.map, s.map_bytes);
}

void ShardWindowSource::read(int32_t* out) {
  // Stream position p maps to token p mod total_tokens_ (the stream repeats every epoch).
  int64_t pos = (windows_ * window_len_) % total_tokens_;
  int64_t left = window_len_;
  auto it = std::upper_bound(shards_.begin(), shards_.end(), pos, [](int64_t p, const Shard& s) { return p < s.start; }) - 1;
  while (left > 0) {
    while (it->num_tokens == 0 || pos >= it->start + it->num_tokens) {  // next shard, wrapping to the first
      if (++it == shards_.end()) it = shards_.begin();
      pos = it->start;
    }
    const int64_t n = std::min(left, it->start + it->num_tokens - pos);
    const uint32_t* src = it->tokens + (pos - it->start);
    uint32_t largest = 0;
    for (int64_t i = 0; i < n; ++i) {
      out[i] = static_cast<int32_t>(src[i]);
      largest = std::max(largest, src[i]);
    }
    // A damaged shard must not reach the embedding with an id beyond its table.
    TITAN_USER_CHECK(largest < vocab_size_, "token shard '", it->path, "' holds token id ", largest,
                     ", outside the tokenizer's vocabulary of ", vocab_size_, ": the shard is corrupt");
    out += n;
    left -= n;
    pos += n;
  }
  ++windows_;
}

nlohmann::json ShardWindowSource::state() const { return {{"windows", windows_}, {"num_tokens", total_tokens_}}; }

void ShardWindowSource::load_state(const nlohmann::json& s) {
  try {
    TITAN_USER_CHECK(json_integer<int64_t>(s.at("num_tokens")) == total_tokens_, "the data loader state was saved for token shards of ",
                     s.at("num_tokens"), " tokens, these hold ", total_tokens_, ": resume with the same shards");
    windows_ = json_integer<int64_t>(s.at("windows"));
  } catch (const nlohmann::json::exception& e) {
    TITAN_USER_CHECK(false, "bad token shard data loader state (", e.what(), "): ", s.dump());
  }
  TITAN_USER_CHECK(windows_ >= 0, "bad token shard data loader state: ", s.dump());
}

}  // namespace titan::data
