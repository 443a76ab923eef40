// Hugging Face tokenizer.json, byte-level BPE (GPT-2, Llama 3 and alike).
//
// Supported, as the `tokenizers` package runs them:
//   model          BPE (merges as "a b" strings or [a, b] pairs, ignore_merges); the vocabulary must
//                  hold all 256 byte-level characters. No dropout, subword prefix/suffix.
//   normalizer     none.
//   pre_tokenizer  ByteLevel (use_regex: GPT-2's pattern; add_prefix_space when it comes first),
//                  Split (Regex or String pattern, behavior Isolated or Removed, not inverted),
//                  or a Sequence of those; a ByteLevel step is required.
//   added_tokens   split out of the text before pre-tokenization, leftmost-longest, special or not
//                  (lstrip / rstrip / single_word are rejected).
//   post_processor TemplateProcessing whose single template is [special]? $A [special]? (the specials
//                  become bos_id / eos_id), ByteLevel (no effect on ids), or a Sequence of those.
//   decoder        ByteLevel.
// Everything else is rejected with a UserError rather than tokenized differently.
#include "titan/components/tokenizer/backends.h"

#include "titan/common/error.h"
#include "titan/common/json_integer.h"
#include "titan/components/tokenizer/bpe.h"
#include "titan/components/tokenizer/byte_level.h"
#include "titan/components/tokenizer/literal_matcher.h"
#include "titan/components/tokenizer/regex_split.h"
#include "titan/common/utf8.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>

namespace titan::tokenizer {

namespace {

using nlohmann::json;

// One pre-tokenization step: split each piece by `regex`, keeping the gaps (Isolated) or not (Removed).
struct SplitStep {
  RegexSplitter regex;
  bool keep_gaps;
};

struct Special {
  std::optional<int32_t> bos, eos;
};

bool is_null_or(const json& j, const char* key, const json& value) {
  return !j.contains(key) || j[key].is_null() || j[key] == value;
}

// A token id written in the file: an int32 (get<int32_t>() of a float out of range is undefined).
int32_t id_of(const json& j, const std::string& path, const std::string& what) {
  TITAN_USER_CHECK(j.is_number_integer(), path, ": the id of ", what, " is not an integer");
  return json_integer<int32_t>(j);  // a type_error (reported with the path) when out of range
}

std::string type_of(const json& j) { return j.is_object() && j.contains("type") ? j["type"].get<std::string>() : ""; }

class HfTokenizer final : public Tokenizer {
 public:
  HfTokenizer(const std::string& path, const json& root) : path_(path) {
    if (auto it = root.find("added_tokens"); it != root.end() && it->is_array()) added_count_ = it->size();
    parse_model(root.at("model"));
    parse_normalizer(root.value("normalizer", json()));
    parse_pre_tokenizer(root.value("pre_tokenizer", json()));
    parse_added_tokens(root.value("added_tokens", json::array()));
    parse_decoder(root.value("decoder", json()));
    parse_post_processor(root.value("post_processor", json()));
    find_bos_eos();
  }

  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool add_eos) const override {
    std::string repaired;
    if (!is_valid_utf8(text)) text = repaired = to_valid_utf8(text);
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 2);
    if (add_bos && bos_) ids.push_back(*bos_);
    if (added_.empty()) {
      if (!text.empty()) encode_segment(text, ids);
    } else {
      added_.split(
          text, [&](size_t b, size_t e) { encode_segment(text.substr(b, e - b), ids); },
          [&](int32_t id) { ids.push_back(id); });
    }
    if (add_eos && eos_) ids.push_back(*eos_);
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string bytes;
    for (int32_t id : ids) {
      TITAN_USER_CHECK(id >= 0 && id < vocab_size() && has_token_[id], "cannot decode token id ", id, ": ", path_,
                       " has no such token (vocabulary size ", vocab_size(), ")");
      bytes += id_bytes_[id];
    }
    return to_valid_utf8(bytes);
  }

  int64_t vocab_size() const override { return static_cast<int64_t>(id_bytes_.size()); }
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::optional<int32_t> eos_id() const override { return eos_; }

 private:
  // A stretch of text without added tokens: pre-tokenize, then BPE each word.
  void encode_segment(std::string_view segment, std::vector<int32_t>& ids) const {
    std::string prefixed;
    if (add_prefix_space_ && segment.front() != ' ') {
      prefixed.reserve(segment.size() + 1);
      prefixed.push_back(' ');
      prefixed.append(segment);
      segment = prefixed;
    }
    split_from(0, segment, ids);
  }

  void split_from(size_t step, std::string_view piece, std::vector<int32_t>& ids) const {
    if (step == steps_.size()) {
      bpe_->encode(piece, ids);
      return;
    }
    const SplitStep& s = steps_[step];
    s.regex.split(piece, [&](size_t b, size_t e, bool is_match) {
      if (is_match || s.keep_gaps) split_from(step + 1, piece.substr(b, e - b), ids);
    });
  }

  void unsupported(const std::string& what) const {
    throw UserError(detail::concat(path_, ": unsupported tokenizer.json: ", what,
                                   ". titan reads byte-level BPE tokenizers (GPT-2 / Llama 3 style); convert the "
                                   "tokenizer or use a tiktoken / SentencePiece model"));
  }

  void set_token(int32_t id, const std::string& content) {
    TITAN_USER_CHECK(id >= 0, path_, ": negative token id ", id, " for '", content, "'");
    // Ids are numbered densely from 0; one far beyond the number of tokens listed would make the id
    // table as large as the id (gigabytes for a damaged digit).
    TITAN_USER_CHECK(id < max_id_, path_, ": token id ", id, " for '", content, "' is far beyond the ", max_id_ - kIdSlack,
                     " tokens the file lists (ids run from 0 to the number of tokens - 1)");
    if (static_cast<size_t>(id) >= id_bytes_.size()) {
      id_bytes_.resize(id + 1);
      has_token_.resize(id + 1, false);
    }
    // The ByteLevel decoder maps each character back to its byte; a token with a character outside the
    // byte-level alphabet is emitted as its own UTF-8 text.
    id_bytes_[id] = byte_level_to_bytes(content).value_or(content);
    has_token_[id] = true;
  }

  void parse_model(const json& model) {
    if (type_of(model) != "BPE") unsupported("model type '" + type_of(model) + "' (only BPE)");
    if (!is_null_or(model, "dropout", json())) unsupported("BPE dropout");
    if (!is_null_or(model, "continuing_subword_prefix", "")) unsupported("BPE continuing_subword_prefix");
    if (!is_null_or(model, "end_of_word_suffix", "")) unsupported("BPE end_of_word_suffix");
    const json& vocab = model.at("vocab");
    TITAN_USER_CHECK(vocab.is_object(), path_, ": model.vocab is not an object of token -> id");
    max_id_ = static_cast<int64_t>(vocab.size() + added_count_) + kIdSlack;
    StringMap<int32_t> raw_tokens;      // raw bytes -> id, for the BPE
    StringMap<int32_t> vocab_ids;       // vocabulary string -> id, to resolve merges
    raw_tokens.reserve(vocab.size());
    vocab_ids.reserve(vocab.size());
    for (const auto& [token, id_json] : vocab.items()) {
      const int32_t id = id_of(id_json, path_, "vocabulary token '" + token + "'");
      set_token(id, token);
      vocab_ids.emplace(token, id);
      if (auto raw = byte_level_to_bytes(token)) raw_tokens.emplace(std::move(*raw), id);
    }
    std::unordered_map<uint64_t, BytePairEncoder::Merge> merges;
    const json& list = model.value("merges", json::array());
    merges.reserve(list.size());
    for (size_t rank = 0; rank < list.size(); ++rank) {
      std::string left, right;
      const json& m = list[rank];
      if (m.is_string()) {  // "a b"
        const auto s = m.get<std::string>();
        const size_t space = s.find(' ');
        TITAN_USER_CHECK(space != std::string::npos && s.find(' ', space + 1) == std::string::npos, path_,
                         ": merge ", rank, " '", s, "' is not two tokens separated by one space");
        left = s.substr(0, space);
        right = s.substr(space + 1);
      } else {
        TITAN_USER_CHECK(m.is_array() && m.size() == 2, path_, ": merge ", rank, " is not a pair: ", m.dump());
        left = m[0].get<std::string>();
        right = m[1].get<std::string>();
      }
      auto l = vocab_ids.find(left), r = vocab_ids.find(right), merged = vocab_ids.find(left + right);
      TITAN_USER_CHECK(l != vocab_ids.end() && r != vocab_ids.end() && merged != vocab_ids.end(), path_,
                       ": merge ", rank, " ('", left, "', '", right, "') uses or makes a token not in the vocabulary");
      merges[BytePairEncoder::pair_key(l->second, r->second)] = {static_cast<int32_t>(rank), merged->second};
    }
    const bool ignore_merges = model.value("ignore_merges", false);
    try {
      bpe_ = std::make_unique<BytePairEncoder>(
          BytePairEncoder::from_merges(std::move(raw_tokens), std::move(merges), ignore_merges));
    } catch (const UserError& e) {
      throw UserError(path_ + ": " + e.what());
    }
  }

  void parse_normalizer(const json& n) {
    if (n.is_null()) return;
    if (type_of(n) == "Sequence" && n.value("normalizers", json::array()).empty()) return;
    unsupported("normalizer " + n.dump().substr(0, 200) + " (only none)");
  }

  void add_pre_tokenizer(const json& p, bool first) {
    const std::string type = type_of(p);
    if (type == "ByteLevel") {
      has_byte_level_ = true;
      if (p.value("add_prefix_space", true)) {
        if (!first) unsupported("ByteLevel add_prefix_space after another pre-tokenizer");
        add_prefix_space_ = true;
      }
      if (p.value("use_regex", true)) steps_.push_back({RegexSplitter(kGpt2Pattern, false, path_), true});
    } else if (type == "Split") {
      const json& pattern = p.at("pattern");
      const std::string behavior = p.value("behavior", "");
      if (p.value("invert", false)) unsupported("Split with invert: true");
      if (behavior != "Isolated" && behavior != "Removed") unsupported("Split behavior '" + behavior + "'");
      const bool literal = pattern.contains("String");
      const std::string source = literal ? pattern.at("String").get<std::string>() : pattern.at("Regex").get<std::string>();
      steps_.push_back({RegexSplitter(source, literal, path_), behavior == "Isolated"});
    } else if (type == "Sequence") {
      const json& list = p.at("pretokenizers");
      for (size_t i = 0; i < list.size(); ++i) add_pre_tokenizer(list[i], first && i == 0);
    } else {
      unsupported("pre-tokenizer '" + type + "' (supported: ByteLevel, Split, Sequence)");
    }
  }

  void parse_pre_tokenizer(const json& p) {
    if (p.is_null()) unsupported("no pre-tokenizer (a ByteLevel pre-tokenizer is required)");
    add_pre_tokenizer(p, true);
    if (!has_byte_level_) unsupported("no ByteLevel pre-tokenizer (the model is not byte-level)");
  }

  void parse_added_tokens(const json& list) {
    for (const json& t : list) {
      const auto content = t.at("content").get<std::string>();
      const int32_t id = id_of(t.at("id"), path_, "added token '" + content + "'");
      for (const char* flag : {"lstrip", "rstrip", "single_word"}) {
        if (t.value(flag, false)) unsupported(std::string("added token '") + content + "' with " + flag + ": true");
      }
      TITAN_USER_CHECK(!content.empty(), path_, ": added token ", id, " is empty");
      set_token(id, content);
      added_.add(content, id);
      added_ids_[content] = id;
    }
  }

  void parse_decoder(const json& d) {
    if (type_of(d) != "ByteLevel") unsupported("decoder " + d.dump().substr(0, 200) + " (only ByteLevel)");
  }

  void parse_template(const json& p) {
    const json& single = p.at("single");
    std::vector<std::optional<int32_t>> items;  // nullopt: the sequence $A
    for (const json& item : single) {
      if (item.contains("Sequence")) {
        if (item["Sequence"].value("id", "A") != "A") unsupported("TemplateProcessing with $B in the single template");
        items.push_back(std::nullopt);
      } else {
        const auto name = item.at("SpecialToken").at("id").get<std::string>();
        const json& ids = p.at("special_tokens").at(name).at("ids");
        if (ids.size() != 1) unsupported("TemplateProcessing special token '" + name + "' with several ids");
        items.push_back(id_of(ids[0], path_, "template special token '" + name + "'"));
      }
    }
    const auto sequences = std::count(items.begin(), items.end(), std::nullopt);
    const bool ok = sequences == 1 && items.size() <= 3 && (items.size() < 3 || !items[1]);
    if (!ok) unsupported("TemplateProcessing single template other than [special] $A [special]");
    if (items.front()) template_.bos = *items.front();
    if (items.back()) template_.eos = *items.back();
  }

  void parse_post_processor(const json& p) {
    const std::string type = type_of(p);
    if (p.is_null() || type == "ByteLevel") return;
    if (type == "TemplateProcessing") {
      parse_template(p);
    } else if (type == "Sequence") {
      for (const json& q : p.at("processors")) parse_post_processor(q);
    } else {
      unsupported("post-processor '" + type + "' (supported: TemplateProcessing, ByteLevel, Sequence)");
    }
  }

  std::optional<int32_t> token_id(const std::string& content) const {
    if (auto it = added_ids_.find(content); it != added_ids_.end()) return it->second;
    if (auto it = bpe_->tokens().find(byte_level_to_bytes(content).value_or(content)); it != bpe_->tokens().end()) {
      return it->second;
    }
    return std::nullopt;
  }

  // BOS / EOS: tokenizer_config.json beside the file (bos_token / eos_token) first, then the
  // post-processor's template, then the usual names.
  void find_bos_eos() {
    Special config;
    const auto config_path = std::filesystem::path(path_).parent_path() / "tokenizer_config.json";
    if (std::filesystem::exists(config_path)) {
      std::ifstream in(config_path);
      const json c = json::parse(in, nullptr, /*allow_exceptions=*/false);
      auto content = [](const json& v) -> std::string {
        if (v.is_string()) return v.get<std::string>();
        if (v.is_object() && v.contains("content")) return v["content"].get<std::string>();
        return "";
      };
      if (c.is_object()) {
        if (c.contains("bos_token")) config.bos = token_id(content(c["bos_token"]));
        if (c.contains("eos_token")) config.eos = token_id(content(c["eos_token"]));
      }
    }
    auto first_known = [&](std::initializer_list<const char*> names) -> std::optional<int32_t> {
      for (const char* n : names) {
        if (auto id = added_ids_.find(n); id != added_ids_.end()) return id->second;
      }
      return std::nullopt;
    };
    bos_ = config.bos ? config.bos : template_.bos ? template_.bos
                                                   : first_known({"<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>"});
    eos_ = config.eos ? config.eos : template_.eos ? template_.eos
                                                   : first_known({"<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>"});
  }

  // Ids may leave a few holes (tokens removed from a vocabulary), not millions.
  static constexpr int64_t kIdSlack = 1 << 16;
  size_t added_count_ = 0;
  int64_t max_id_ = kIdSlack;  // set by parse_model: the number of listed tokens + kIdSlack
  std::string path_;
  std::unique_ptr<BytePairEncoder> bpe_;
  std::vector<SplitStep> steps_;
  bool add_prefix_space_ = false;
  bool has_byte_level_ = false;
  LiteralMatcher added_;
  std::unordered_map<std::string, int32_t> added_ids_;
  std::vector<std::string> id_bytes_;  // id -> bytes it decodes to
  std::vector<bool> has_token_;
  Special template_;
  std::optional<int32_t> bos_, eos_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_hf_tokenizer(const std::string& path) {
  std::ifstream in(path);
  TITAN_USER_CHECK(in, "cannot open tokenizer file ", path);
  json root;
  try {
    root = json::parse(in);
  } catch (const json::exception& e) {
    throw UserError(detail::concat(path, ": not a valid tokenizer.json (JSON parse error: ", e.what(), ")"));
  }
  TITAN_USER_CHECK(root.is_object() && root.contains("model"), path,
                   ": not a Hugging Face tokenizer.json (no \"model\" section)");
  try {
    return std::make_unique<HfTokenizer>(path, root);
  } catch (const json::exception& e) {
    throw UserError(detail::concat(path, ": malformed tokenizer.json (", e.what(), ")"));
  }
}

}  // namespace titan::tokenizer
