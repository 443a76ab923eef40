// UTF-8 helpers of the tokenizers: validation and lossy repair.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace titan::tokenizer {

// Length in bytes of the valid UTF-8 sequence starting at text[i], or 0 when text[i] does not start one
// (stray continuation byte, overlong form, surrogate, code point > U+10FFFF, truncated sequence).
size_t utf8_sequence_length(std::string_view text, size_t i);

// Whether `text` is entirely valid UTF-8.
bool is_valid_utf8(std::string_view text);

// `text` with every ill-formed part replaced by U+FFFD, one per maximal ill-formed subpart (the
// Unicode-recommended practice, as Python's errors="replace" and Rust's from_utf8_lossy do).
std::string to_valid_utf8(std::string_view text);

// Appends the UTF-8 encoding of code point `cp` (< 0x110000) to `out`.
void append_utf8(uint32_t cp, std::string& out);

}  // namespace titan::tokenizer
