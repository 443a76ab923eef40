// Pre-tokenization by regular expression (PCRE2 with UTF and Unicode properties, JIT-compiled).
//
// Hugging Face's Split pre-tokenizer (Oniguruma) and tiktoken (fancy-regex) define \s as Unicode
// White_Space; PCRE2's \s also matches U+180E. The pattern is rewritten so that \s and \S mean
// White_Space exactly: \s -> a class listing White_Space (and its negation), inside and outside classes (a \S inside
// a character class is rejected, as it has no such rewrite).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace titan::tokenizer {

// Llama 3's pre-tokenizer pattern (also tiktoken's cl100k_base).
inline constexpr std::string_view kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
// GPT-2's pattern (Hugging Face's ByteLevel pre-tokenizer with use_regex).
inline constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class RegexSplitter {
 public:
  // Compiles `pattern` (a regular expression, or a literal string when `literal`). Throws UserError
  // naming `origin` when it does not compile.
  RegexSplitter(std::string_view pattern, bool literal, const std::string& origin);
  ~RegexSplitter();
  RegexSplitter(RegexSplitter&&) noexcept;
  RegexSplitter(const RegexSplitter&) = delete;

  // Calls on_piece(begin, end, is_match) for the consecutive parts of `text` (valid UTF-8) in order:
  // the non-empty matches (is_match) and the non-empty gaps between them (!is_match). Thread-safe.
  void split(std::string_view text, const std::function<void(size_t, size_t, bool)>& on_piece) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The pattern with \s and \S rewritten to Unicode White_Space (see above).
std::string rewrite_whitespace_classes(std::string_view pattern);

}  // namespace titan::tokenizer
