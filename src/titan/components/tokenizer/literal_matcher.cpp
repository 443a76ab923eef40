#include "titan/components/tokenizer/literal_matcher.h"

#include "titan/common/error.h"

namespace titan::tokenizer {

int32_t LiteralMatcher::child(int32_t node, uint8_t byte) const {
  auto it = edges_.find((static_cast<uint64_t>(node) << 8) | byte);
  return it == edges_.end() ? -1 : it->second;
}

void LiteralMatcher::add(std::string_view literal, int32_t id) {
  TITAN_ASSERT(!literal.empty());
  first_byte_[static_cast<uint8_t>(literal[0])] = true;
  int32_t node = 0;
  for (char c : literal) {
    const auto byte = static_cast<uint8_t>(c);
    int32_t next = child(node, byte);
    if (next < 0) {
      next = static_cast<int32_t>(nodes_.size());
      nodes_.push_back({});
      edges_[(static_cast<uint64_t>(node) << 8) | byte] = next;
    }
    node = next;
  }
  nodes_[node].id = id;
}

void LiteralMatcher::split(std::string_view text, const std::function<void(size_t, size_t)>& on_text,
                           const std::function<void(int32_t)>& on_token) const {
  size_t plain_begin = 0;
  size_t i = 0;
  while (i < text.size()) {
    if (!first_byte_[static_cast<uint8_t>(text[i])]) {
      ++i;
      continue;
    }
    int32_t node = 0, best_id = -1;
    size_t best_end = 0;
    for (size_t j = i; j < text.size(); ++j) {
      node = child(node, static_cast<uint8_t>(text[j]));
      if (node < 0) break;
      if (nodes_[node].id >= 0) {
        best_id = nodes_[node].id;
        best_end = j + 1;
      }
    }
    if (best_id < 0) {
      ++i;
      continue;
    }
    if (i > plain_begin) on_text(plain_begin, i);
    on_token(best_id);
    i = plain_begin = best_end;
  }
  if (plain_begin < text.size()) on_text(plain_begin, text.size());
}

}  // namespace titan::tokenizer
