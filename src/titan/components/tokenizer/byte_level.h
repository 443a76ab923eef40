// GPT-2's byte-level alphabet: a bijection between the 256 byte values and 256 printable Unicode
// characters, so that byte strings can be written as vocabulary strings in tokenizer.json.
// Printable bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) stand for themselves; the others map, in byte
// order, to U+0100, U+0101, ... (so ' ' (0x20) is 'Ġ' U+0120 and '\n' is 'Ċ' U+010A).
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace titan::tokenizer {

// Code point standing for each byte.
const std::array<uint32_t, 256>& byte_to_code_point();

// The raw bytes a byte-level vocabulary string stands for; nullopt when a character of `token` is not
// in the byte-level alphabet (e.g. an added token such as "hello world").
std::optional<std::string> byte_level_to_bytes(std::string_view token);

}  // namespace titan::tokenizer
