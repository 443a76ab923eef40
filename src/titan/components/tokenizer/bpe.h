// Byte-pair encoding of one pre-tokenized word (a byte string) into token ids, shared by the
// Hugging Face byte-level BPE and the tiktoken tokenizers.
//
// Both merge the same way: start from one symbol per byte, repeatedly merge the adjacent pair of lowest
// rank (the leftmost one on ties) until no adjacent pair has a rank. They differ in where ranks come from:
//   - merges (tokenizer.json): the rank of the pair (left id, right id) in the merges list; the merged
//     symbol gets the vocabulary id of the concatenation;
//   - ranks (tiktoken): the rank of the concatenated bytes, which is also the merged symbol's id.
// With `whole_word_first`, a word that is itself a token is emitted as that token without merging
// (tokenizer.json's ignore_merges; tiktoken always does this).
//
// Results are cached per word (words up to kMaxCachedWordBytes bytes); encode is thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace titan::tokenizer {

// Hash of std::string keys that also accepts std::string_view (lookups without a copy).
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

class BytePairEncoder {
 public:
  struct Merge {
    int32_t rank;
    int32_t id;  // id of the merged token
  };
  static constexpr size_t kMaxCachedWordBytes = 128;
  // ~10 MB at most (an entry is ~150 bytes); Hugging Face's tokenizers keep 10,000 words.
  static constexpr size_t kMaxCacheEntries = 1 << 16;

  // tokenizer.json style. `tokens`: raw token bytes -> id (every single byte must be present);
  // `merges`: pair_key(left id, right id) -> Merge.
  static BytePairEncoder from_merges(StringMap<int32_t> tokens, std::unordered_map<uint64_t, Merge> merges,
                                     bool whole_word_first);
  // tiktoken style: raw token bytes -> rank (= id); every single byte must be present.
  static BytePairEncoder from_ranks(StringMap<int32_t> ranks);

  static uint64_t pair_key(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }

  BytePairEncoder(BytePairEncoder&& other) noexcept;

  // Appends the ids of `word` (non-empty) to `out`.
  void encode(std::string_view word, std::vector<int32_t>& out) const;

  // Raw token bytes -> id, as given at construction.
  const StringMap<int32_t>& tokens() const { return tokens_; }

 private:
  BytePairEncoder() = default;
  void init_byte_ids();  // byte_ids_ from tokens_; every byte must be a token
  // The rank and merged id of the adjacent symbols word[start, mid) and word[mid, end), if they merge.
  bool lookup(std::string_view word, size_t start, size_t mid, size_t end, int32_t left_id, int32_t right_id,
              Merge& merge) const;
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  bool use_merges_ = false;
  bool whole_word_first_ = false;
  StringMap<int32_t> tokens_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::array<int32_t, 256> byte_ids_{};

  // The merges of recent words, in shards of their own lock so that threads encoding at once (titan
  // tokenize's workers) rarely wait for each other.
  static constexpr size_t kCacheShards = 64;
  struct CacheShard {
    std::mutex mutex;
    StringMap<std::vector<int32_t>> words;
  };
  mutable std::array<CacheShard, kCacheShards> cache_;
};

}  // namespace titan::tokenizer
