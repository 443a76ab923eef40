// tiktoken model files as Llama 3 ships them (original/tokenizer.model): one "base64(token bytes) rank"
// line per token, ranks 0..n-1. Llama 3's pre-tokenizer pattern and its 256 special tokens (ids n..n+255)
// complete the tokenizer, as Meta's reference code and torchtitan's TikTokenizer define them.
// Special tokens written in the text are recognized (tiktoken's allowed_special="all").
#include "titan/components/tokenizer/backends.h"

#include "titan/common/error.h"
#include "titan/components/tokenizer/bpe.h"
#include "titan/components/tokenizer/literal_matcher.h"
#include "titan/components/tokenizer/regex_split.h"
#include "titan/common/utf8.h"

#include <fstream>
#include <sstream>

namespace titan::tokenizer {

namespace {

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// Standard base64 with padding; nullopt when malformed.
std::optional<std::string> base64_decode(std::string_view s) {
  if (s.empty() || s.size() % 4 != 0) return std::nullopt;
  std::string out;
  out.reserve(s.size() / 4 * 3);
  for (size_t i = 0; i < s.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s[i + k];
      if (c == '=' && i + 4 == s.size() && k >= 2) {
        v[k] = 0;
        ++pad;
      } else {
        if (pad > 0) return std::nullopt;  // data after padding
        v[k] = base64_value(c);
        if (v[k] < 0) return std::nullopt;
      }
    }
    const uint32_t n = (v[0] << 18) | (v[1] << 12) | (v[2] << 6) | v[3];
    out.push_back(static_cast<char>(n >> 16));
    if (pad < 2) out.push_back(static_cast<char>((n >> 8) & 0xFF));
    if (pad < 1) out.push_back(static_cast<char>(n & 0xFF));
  }
  return out;
}

bool parse_line(std::string_view line, std::string& token, int64_t& rank) {
  const size_t space = line.find(' ');
  if (space == std::string_view::npos || space + 1 >= line.size()) return false;
  auto bytes = base64_decode(line.substr(0, space));
  if (!bytes) return false;
  rank = 0;
  for (char c : line.substr(space + 1)) {
    if (c < '0' || c > '9' || rank > (int64_t{1} << 40)) return false;
    rank = rank * 10 + (c - '0');
  }
  token = std::move(*bytes);
  return true;
}

class TiktokenTokenizer final : public Tokenizer {
 public:
  TiktokenTokenizer(const std::string& path, StringMap<int32_t> ranks, std::vector<std::string> id_bytes)
      : bpe_(BytePairEncoder::from_ranks(std::move(ranks))),
        regex_(kLlama3Pattern, false, path),
        id_bytes_(std::move(id_bytes)),
        path_(path) {
    const auto base = static_cast<int32_t>(id_bytes_.size());
    const std::vector<std::string> specials = llama3_special_tokens();
    for (size_t i = 0; i < specials.size(); ++i) {
      specials_.add(specials[i], base + static_cast<int32_t>(i));
      id_bytes_.push_back(specials[i]);
    }
    bos_ = base;      // <|begin_of_text|>
    eos_ = base + 1;  // <|end_of_text|>
  }

  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool add_eos) const override {
    std::string repaired;
    if (!is_valid_utf8(text)) text = repaired = to_valid_utf8(text);
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 2);
    if (add_bos) ids.push_back(bos_);
    specials_.split(
        text,
        [&](size_t b, size_t e) {
          const std::string_view segment = text.substr(b, e - b);
          // tiktoken keeps only the pattern's matches (Llama 3's pattern matches every character).
          regex_.split(segment, [&](size_t pb, size_t pe, bool is_match) {
            if (is_match) bpe_.encode(segment.substr(pb, pe - pb), ids);
          });
        },
        [&](int32_t id) { ids.push_back(id); });
    if (add_eos) ids.push_back(eos_);
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string bytes;
    for (int32_t id : ids) {
      TITAN_USER_CHECK(id >= 0 && id < vocab_size(), "cannot decode token id ", id, ": ", path_,
                       " has ids 0..", vocab_size() - 1);
      bytes += id_bytes_[id];
    }
    return to_valid_utf8(bytes);
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(id_bytes_.size()); }
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::optional<int32_t> eos_id() const override { return eos_; }

 private:
  BytePairEncoder bpe_;
  RegexSplitter regex_;
  LiteralMatcher specials_;
  std::vector<std::string> id_bytes_;
  std::string path_;
  int32_t bos_, eos_;
};

}  // namespace

std::vector<std::string> llama3_special_tokens() {
  std::vector<std::string> t = {
      "<|begin_of_text|>",           "<|end_of_text|>",           "<|reserved_special_token_0|>",
      "<|reserved_special_token_1|>", "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
      "<|start_header_id|>",         "<|end_header_id|>",         "<|reserved_special_token_4|>",
      "<|eot_id|>"};
  for (int i = 5; i < 256 - 5; ++i) t.push_back("<|reserved_special_token_" + std::to_string(i) + "|>");
  return t;  // 256 tokens
}

bool looks_like_tiktoken(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string line;
  if (!in || !std::getline(in, line)) return false;
  std::string token;
  int64_t rank;
  return parse_line(line, token, rank);
}

std::unique_ptr<Tokenizer> load_tiktoken_tokenizer(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TITAN_USER_CHECK(in, "cannot open tokenizer file ", path);
  StringMap<int32_t> ranks;
  std::vector<std::string> id_bytes;
  std::string line, token;
  int64_t line_number = 0, rank = 0;
  while (std::getline(in, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    TITAN_USER_CHECK(parse_line(line, token, rank), path, ":", line_number,
                     ": not a tiktoken line (expected '<base64 token> <rank>')");
    TITAN_USER_CHECK(rank == static_cast<int64_t>(id_bytes.size()), path, ":", line_number, ": rank ", rank,
                     " out of order (titan expects ranks 0, 1, 2, ... as in Llama 3's tokenizer.model)");
    TITAN_USER_CHECK(ranks.emplace(token, static_cast<int32_t>(rank)).second, path, ":", line_number,
                     ": token listed twice");
    id_bytes.push_back(token);
  }
  TITAN_USER_CHECK(!id_bytes.empty(), path, ": empty tiktoken file");
  try {
    return std::make_unique<TiktokenTokenizer>(path, std::move(ranks), std::move(id_bytes));
  } catch (const UserError& e) {
    throw UserError(path + ": " + e.what());
  }
}

}  // namespace titan::tokenizer
