// Finds special / added tokens written in a text: leftmost-longest matching of a set of literal
// strings (as Hugging Face's added-vocabulary split and tiktoken's special-token regex do).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace titan::tokenizer {

class LiteralMatcher {
 public:
  // Adds `literal` (non-empty) standing for token `id`; a later add of the same literal replaces the id.
  void add(std::string_view literal, int32_t id);
  bool empty() const { return nodes_.size() == 1; }

  // Calls on_text(begin, end) for each non-empty stretch of `text` without literals and on_token(id)
  // for each literal found, in text order. At each position the longest literal starting there wins;
  // the scan resumes after it.
  void split(std::string_view text, const std::function<void(size_t, size_t)>& on_text,
             const std::function<void(int32_t)>& on_token) const;

 private:
  struct Node {
    int32_t id = -1;  // token ending here, or -1
  };
  int32_t child(int32_t node, uint8_t byte) const;

  std::vector<Node> nodes_{Node{}};
  std::unordered_map<uint64_t, int32_t> edges_;  // (node << 8 | byte) -> child node
  std::array<bool, 256> first_byte_{};
};

}  // namespace titan::tokenizer
