#include "titan/components/data/token_files.h"

#include "titan/common/error.h"
#include "titan/common/json_integer.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>

namespace titan::data {
namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little, "the token file formats are little-endian");

int64_t token_bytes(TokenType t) {
  switch (t) {
    case TokenType::U8:
    case TokenType::I8: return 1;
    case TokenType::I16:
    case TokenType::U16: return 2;
    case TokenType::I32:
    case TokenType::U32: return 4;
    case TokenType::I64: return 8;
  }
  return 0;
}

const char* token_type_name(TokenType t) {
  switch (t) {
    case TokenType::U8: return "uint8";
    case TokenType::I8: return "int8";
    case TokenType::I16: return "int16";
    case TokenType::U16: return "uint16";
    case TokenType::I32: return "int32";
    case TokenType::U32: return "uint32";
    case TokenType::I64: return "int64";
  }
  return "?";
}

MappedTokenSource::MappedTokenSource(std::string kind, std::string what, int64_t seq_len, int64_t vocab_size)
    : kind_(std::move(kind)), what_(std::move(what)), window_len_(seq_len + 1), vocab_size_(vocab_size) {
  TITAN_USER_CHECK(seq_len >= 1, "seq_len must be at least 1, got ", seq_len);
}

MappedTokenSource::~MappedTokenSource() {
  for (const Mapped& m : maps_)
    if (m.bytes) ::munmap(const_cast<char*>(m.data), m.bytes);
}

MappedTokenSource::Mapped MappedTokenSource::map_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  TITAN_USER_CHECK(fd >= 0, "cannot open ", what_, " '", path, "': ", std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  Mapped m;
  m.bytes = static_cast<size_t>(st.st_size);
  if (m.bytes == 0) {  // mmap refuses an empty file; the caller's size checks report it
    ::close(fd);
    static const char kNothing = 0;
    m.data = &kNothing;
    return m;
  }
  void* map = ::mmap(nullptr, m.bytes, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  TITAN_USER_CHECK(map != MAP_FAILED, "cannot map ", what_, " '", path, "': ", std::strerror(err));
  m.data = static_cast<const char*>(map);
  maps_.push_back(m);  // unmapped by the destructor
  return m;
}

void MappedTokenSource::add_segment(const std::string& path, const char* tokens, TokenType type, int64_t num_tokens) {
  segments_.push_back({path, tokens, type, num_tokens, total_tokens_});
  total_tokens_ += num_tokens;
}

void MappedTokenSource::finish(const std::string& source) {
  TITAN_USER_CHECK(total_tokens_ > 0, "'", source, "' holds no tokens: nothing to train on");
}

namespace {

// Copies n tokens of type T to out; returns the largest and smallest as int64.
template <class T>
void copy_tokens(const char* src, int64_t n, int32_t* out, int64_t& lo, int64_t& hi) {
  for (int64_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, src + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
    const auto x = static_cast<int64_t>(v);
    lo = std::min(lo, x);
    hi = std::max(hi, x);
    out[i] = static_cast<int32_t>(x);
  }
}

}  // namespace

void MappedTokenSource::read(int32_t* out) {
  // Stream position p maps to token p mod total_tokens_ (the stream repeats every epoch).
  int64_t pos = (windows_ * window_len_) % total_tokens_;
  int64_t left = window_len_;
  auto it = std::upper_bound(segments_.begin(), segments_.end(), pos,
                             [](int64_t p, const Segment& s) { return p < s.start; }) -
            1;
  while (left > 0) {
    while (it->num_tokens == 0 || pos >= it->start + it->num_tokens) {  // next segment, wrapping to the first
      if (++it == segments_.end()) it = segments_.begin();
      pos = it->start;
    }
    const int64_t n = std::min(left, it->start + it->num_tokens - pos);
    const char* src = it->tokens + (pos - it->start) * token_bytes(it->type);
    int64_t lo = 0, hi = 0;
    switch (it->type) {
      case TokenType::U8: copy_tokens<uint8_t>(src, n, out, lo, hi); break;
      case TokenType::I8: copy_tokens<int8_t>(src, n, out, lo, hi); break;
      case TokenType::I16: copy_tokens<int16_t>(src, n, out, lo, hi); break;
      case TokenType::U16: copy_tokens<uint16_t>(src, n, out, lo, hi); break;
      case TokenType::I32: copy_tokens<int32_t>(src, n, out, lo, hi); break;
      case TokenType::U32: copy_tokens<uint32_t>(src, n, out, lo, hi); break;
      case TokenType::I64: copy_tokens<int64_t>(src, n, out, lo, hi); break;
    }
    // A damaged file, or one made with another tokenizer, must not reach the embedding with an id
    // beyond its table.
    TITAN_USER_CHECK(lo >= 0 && hi < vocab_size_, what_, " '", it->path, "' holds token id ", lo < 0 ? lo : hi,
                     ", outside the tokenizer's vocabulary of ", vocab_size_,
                     ": the file is corrupt or was made with another tokenizer");
    out += n;
    left -= n;
    pos += n;
  }
  ++windows_;
}

nlohmann::json MappedTokenSource::state() const { return {{"windows", windows_}, {"num_tokens", total_tokens_}}; }

void MappedTokenSource::load_state(const nlohmann::json& s) {
  int64_t windows = 0;
  try {
    TITAN_USER_CHECK(json_integer<int64_t>(s.at("num_tokens")) == total_tokens_, "the data loader state was saved for ",
                     kind_, " data of ", s.at("num_tokens"), " tokens, this data holds ", total_tokens_,
                     ": resume with the same data");
    windows = json_integer<int64_t>(s.at("windows"));
  } catch (const nlohmann::json::exception& e) {
    TITAN_USER_CHECK(false, "bad ", kind_, " data loader state (", e.what(), "): ", s.dump());
  }
  // A count whose stream position (windows * window length) overflows is no state a run saved.
  TITAN_USER_CHECK(windows >= 0 && windows <= std::numeric_limits<int64_t>::max() / window_len_ / 2, "bad ", kind_,
                   " data loader state: ", s.dump());
  windows_ = windows;
}

// ---------------------------------------------------------------------------------------------
// Finding the files

namespace {

constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
// llm.c's two header kinds (dev/data/data_common.py): GPT-2's uint16 tokens, Llama 3's uint32 tokens.
constexpr int32_t kLlmcMagicGpt2 = 20240520, kLlmcVersionGpt2 = 1;
constexpr int32_t kLlmcMagicLlama3 = 20240801, kLlmcVersionLlama3 = 7;
constexpr size_t kLlmcHeaderBytes = 256 * 4;

bool starts_with_bytes(const std::string& path, const void* bytes, size_t n) {
  std::ifstream in(path, std::ios::binary);
  std::string head(n, '\0');
  return in.read(head.data(), static_cast<std::streamsize>(n)) && std::memcmp(head.data(), bytes, n) == 0;
}

bool is_llmc_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec) && (starts_with_bytes(path, &kLlmcMagicGpt2, sizeof(int32_t)) ||
                                           starts_with_bytes(path, &kLlmcMagicLlama3, sizeof(int32_t)));
}

// The prefix that `path` names: PREFIX, PREFIX.idx or PREFIX.bin with PREFIX.idx beside it; "" if none.
std::string megatron_prefix_of(const std::string& path) {
  std::error_code ec;
  auto has_idx = [&](const std::string& prefix) { return fs::is_regular_file(prefix + ".idx", ec); };
  const fs::path p(path);
  if ((p.extension() == ".idx" || p.extension() == ".bin") && has_idx((p.parent_path() / p.stem()).string()))
    return (p.parent_path() / p.stem()).string();
  if (!fs::is_directory(p, ec) && has_idx(path)) return path;
  return "";
}

std::vector<fs::path> sorted_files_with(const std::string& dir, const std::string& extension) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_regular_file(ec) && e.path().extension() == extension) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

// A shell pattern: has *, ? or [ and is not itself an existing path ("c4[en]/" may be a folder's name).
bool is_pattern(const std::string& path) {
  std::error_code ec;
  return path.find_first_of("*?[") != std::string::npos && !fs::exists(path, ec);
}

// The files a shell pattern matches, sorted (glob's order).
std::vector<std::string> glob_files(const std::string& pattern) {
  glob_t g{};
  std::vector<std::string> out;
  if (::glob(pattern.c_str(), 0, nullptr, &g) == 0)
    for (size_t i = 0; i < g.gl_pathc; ++i) out.emplace_back(g.gl_pathv[i]);
  ::globfree(&g);
  return out;
}

}  // namespace

bool names_existing_data(const std::string& path) {
  std::error_code ec;
  return is_pattern(path) ? !glob_files(path).empty() : fs::exists(path, ec) || !megatron_prefix_of(path).empty();
}

std::vector<std::string> megatron_prefixes(const std::string& path) {
  std::vector<std::string> out;
  if (is_pattern(path)) {  // e.g. data/corpus_*_text_document.idx
    std::set<std::string> seen;  // x.bin, x.c.bin, x.c.idx, x.idx: each prefix once, in sorted order
    for (const std::string& file : glob_files(path))
      if (std::string prefix = megatron_prefix_of(file); !prefix.empty() && seen.insert(prefix).second)
        out.push_back(prefix);
    std::sort(out.begin(), out.end());
    return out;
  }
  if (std::string prefix = megatron_prefix_of(path); !prefix.empty()) return {prefix};
  std::error_code ec;
  if (fs::is_directory(path, ec))
    for (const auto& idx : sorted_files_with(path, ".idx")) out.push_back((idx.parent_path() / idx.stem()).string());
  return out;
}

std::vector<std::string> llmc_files(const std::string& path) {
  std::error_code ec;
  if (is_pattern(path)) {  // llm.c's own form: fineweb10B/fineweb_train_*.bin
    std::vector<std::string> out;
    for (const std::string& file : glob_files(path))
      if (fs::is_regular_file(file, ec)) out.push_back(file);
    return out;
  }
  if (!fs::is_directory(path, ec)) return is_llmc_file(path) ? std::vector<std::string>{path} : std::vector<std::string>{};
  std::vector<std::string> out;
  for (const auto& bin : sorted_files_with(path, ".bin")) out.push_back(bin.string());
  return out;
}

std::string token_file_kind(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec) && fs::is_regular_file(fs::path(path) / "manifest.json", ec)) return "shards";
  if (!megatron_prefixes(path).empty()) return "megatron";
  const std::vector<std::string> bins = llmc_files(path);
  if (!bins.empty() && is_llmc_file(bins.front())) return "llmc";
  return "";
}

// ---------------------------------------------------------------------------------------------
// Megatron-LM

namespace {

struct MegatronIndexHeader {
  uint64_t version;
  uint8_t dtype;
  uint64_t sequences;
  uint64_t documents;
};
constexpr size_t kMegatronHeaderBytes = 9 + 8 + 1 + 8 + 8;

// Megatron's DType codes; the floating-point ones cannot hold token ids.
bool megatron_token_type(uint8_t code, TokenType& t) {
  switch (code) {
    case 1: t = TokenType::U8; return true;
    case 2: t = TokenType::I8; return true;
    case 3: t = TokenType::I16; return true;
    case 4: t = TokenType::I32; return true;
    case 5: t = TokenType::I64; return true;
    case 8: t = TokenType::U16; return true;
    default: return false;
  }
}

}  // namespace

MegatronWindowSource::MegatronWindowSource(const std::string& path, int64_t vocab_size, int64_t seq_len)
    : MappedTokenSource("megatron", "Megatron dataset file", seq_len, vocab_size) {
  const std::vector<std::string> prefixes = megatron_prefixes(path);
  TITAN_USER_CHECK(!prefixes.empty(), "'", path, "' names no Megatron-LM indexed dataset (PREFIX.idx and PREFIX.bin)");
  for (const std::string& prefix : prefixes) {
    const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
    const Mapped idx = map_file(idx_path);
    TITAN_USER_CHECK(idx.bytes >= kMegatronHeaderBytes && std::memcmp(idx.data, kMegatronMagic, 9) == 0, "'", idx_path,
                     "' is not a Megatron-LM index (no MMIDIDX header): write it with Megatron's "
                     "tools/preprocess_data.py, or give the data's own format");
    MegatronIndexHeader h{};
    std::memcpy(&h.version, idx.data + 9, 8);
    std::memcpy(&h.dtype, idx.data + 17, 1);
    std::memcpy(&h.sequences, idx.data + 18, 8);
    std::memcpy(&h.documents, idx.data + 26, 8);
    TITAN_USER_CHECK(h.version == 1, "'", idx_path, "' is a version-", h.version,
                     " Megatron index; titan reads version 1 (MMIDIDX)");
    TokenType type{};
    TITAN_USER_CHECK(megatron_token_type(h.dtype, type), "'", idx_path, "' stores its tokens with dtype code ",
                     static_cast<int>(h.dtype), ", which is not an integer type (codes 1-5 and 8 are)");
    // Megatron picks uint16 below 65,500 tokens and int32 from there (DType.optimal_dtype).
    const bool small_vocab = vocab_size < 65500;
    TITAN_USER_CHECK(!(type == TokenType::U16 && !small_vocab) && !(type == TokenType::I32 && small_vocab), "'",
                     idx_path, "' stores ", token_type_name(type), " token ids, which Megatron writes for a vocabulary ",
                     type == TokenType::U16 ? "below" : "of at least", " 65,500 tokens, but this run's tokenizer has ",
                     vocab_size, ": the data was tokenized with another tokenizer; tokenize it with the model's");
    const uint64_t available = (idx.bytes - kMegatronHeaderBytes);
    TITAN_USER_CHECK(h.sequences <= available / 12 && h.documents <= (available - 12 * h.sequences) / 8, "'", idx_path,
                     "' is ", idx.bytes, " bytes, too short for its ", h.sequences, " sequences and ", h.documents,
                     " documents (truncated?)");
    const char* lengths = idx.data + kMegatronHeaderBytes;
    const char* pointers = lengths + 4 * h.sequences;
    const int64_t item = token_bytes(type);
    int64_t tokens = 0;
    for (uint64_t i = 0; i < h.sequences; ++i) {
      int32_t length;
      int64_t pointer;
      std::memcpy(&length, lengths + 4 * i, 4);
      std::memcpy(&pointer, pointers + 8 * i, 8);
      // The writer puts the sequences back to back: each one starts where the previous one ended.
      // (tokens stays below 2^63 / item, so tokens * item cannot overflow.)
      TITAN_USER_CHECK(length >= 0 && length <= std::numeric_limits<int64_t>::max() / item - tokens &&
                           pointer == tokens * item,
                       "'", idx_path, "': sequence ", i, " (length ", length, ", at byte ", pointer,
                       ") does not follow the previous one; the index is corrupt");
      tokens += length;
    }
    num_documents_ += h.documents > 0 ? static_cast<int64_t>(h.documents) - 1 : 0;  // the last entry ends the list
    const Mapped bin = map_file(bin_path);
    TITAN_USER_CHECK(bin.bytes >= static_cast<uint64_t>(tokens * item), "'", bin_path, "' is ", bin.bytes,
                     " bytes, too short for the ", tokens, " ", token_type_name(type), " tokens of its index (truncated?)");
    add_segment(bin_path, bin.data, type, tokens);
  }
  finish(path);
}

// ---------------------------------------------------------------------------------------------
// llm.c

LlmcWindowSource::LlmcWindowSource(const std::string& path, int64_t vocab_size, int64_t seq_len)
    : MappedTokenSource("llmc", "llm.c token file", seq_len, vocab_size) {
  const std::vector<std::string> files = llmc_files(path);
  TITAN_USER_CHECK(!files.empty(), "'", path, "' names no llm.c token file (.bin)");
  for (const std::string& file : files) {
    const Mapped m = map_file(file);
    int32_t header[3] = {};
    if (m.bytes >= sizeof header) std::memcpy(header, m.data, sizeof header);
    const bool gpt2 = header[0] == kLlmcMagicGpt2, llama3 = header[0] == kLlmcMagicLlama3;
    TITAN_USER_CHECK(m.bytes >= kLlmcHeaderBytes && (gpt2 || llama3), "'", file,
                     "' is not an llm.c token file (its header does not start with ", kLlmcMagicGpt2, " or ",
                     kLlmcMagicLlama3, ")");
    TITAN_USER_CHECK((gpt2 && header[1] == kLlmcVersionGpt2) || (llama3 && header[1] == kLlmcVersionLlama3), "'", file,
                     "' is an llm.c token file of version ", header[1], "; titan reads version ", kLlmcVersionGpt2,
                     " (magic ", kLlmcMagicGpt2, ", uint16 tokens) and version ", kLlmcVersionLlama3, " (magic ",
                     kLlmcMagicLlama3, ", uint32 tokens)");
    const TokenType type = gpt2 ? TokenType::U16 : TokenType::U32;
    TITAN_USER_CHECK(type == TokenType::U32 || vocab_size <= 65536, "'", file,
                     "' stores uint16 token ids (llm.c's GPT-2 format), but this run's tokenizer has ", vocab_size,
                     " tokens: the data was tokenized with another tokenizer; tokenize it with the model's");
    const int64_t n = header[2];
    TITAN_USER_CHECK(n >= 0 && m.bytes >= kLlmcHeaderBytes + static_cast<uint64_t>(n) * token_bytes(type), "'", file,
                     "' is ", m.bytes, " bytes, too short for the ", n, " tokens of its header (truncated?)");
    add_segment(file, m.data + kLlmcHeaderBytes, type, n);
  }
  finish(path);
}

}  // namespace titan::data
