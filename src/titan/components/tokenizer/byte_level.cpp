#include "titan/components/tokenizer/byte_level.h"

#include "titan/common/utf8.h"

#include <unordered_map>

namespace titan::tokenizer {

const std::array<uint32_t, 256>& byte_to_code_point() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      t[b] = printable ? b : next++;
    }
    return t;
  }();
  return table;
}

std::optional<std::string> byte_level_to_bytes(std::string_view token) {
  static const std::unordered_map<uint32_t, uint8_t> to_byte = [] {
    std::unordered_map<uint32_t, uint8_t> m;
    for (int b = 0; b < 256; ++b) m[byte_to_code_point()[b]] = static_cast<uint8_t>(b);
    return m;
  }();
  std::string out;
  out.reserve(token.size());
  size_t i = 0;
  while (i < token.size()) {
    const size_t n = utf8_sequence_length(token, i);
    if (n == 0) return std::nullopt;
    uint32_t cp = static_cast<uint8_t>(token[i]);
    if (n > 1) {
      cp &= (0xFF >> (n + 1));
      for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<uint8_t>(token[i + k]) & 0x3F);
    }
    auto it = to_byte.find(cp);
    if (it == to_byte.end()) return std::nullopt;
    out.push_back(static_cast<char>(it->second));
    i += n;
  }
  return out;
}

}  // namespace titan::tokenizer
