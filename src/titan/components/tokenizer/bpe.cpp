#include "titan/components/tokenizer/bpe.h"

#include "titan/common/error.h"

#include <algorithm>
#include <iomanip>
#include <sstream>

namespace titan::tokenizer {

BytePairEncoder BytePairEncoder::from_merges(StringMap<int32_t> tokens, std::unordered_map<uint64_t, Merge> merges,
                                             bool whole_word_first) {
  BytePairEncoder bpe;
  bpe.use_merges_ = true;
  bpe.whole_word_first_ = whole_word_first;
  bpe.tokens_ = std::move(tokens);
  bpe.merges_ = std::move(merges);
  bpe.init_byte_ids();
  return bpe;
}

BytePairEncoder BytePairEncoder::from_ranks(StringMap<int32_t> ranks) {
  BytePairEncoder bpe;
  bpe.use_merges_ = false;
  bpe.whole_word_first_ = true;
  bpe.tokens_ = std::move(ranks);
  bpe.init_byte_ids();
  return bpe;
}

BytePairEncoder::BytePairEncoder(BytePairEncoder&& other) noexcept
    : use_merges_(other.use_merges_),
      whole_word_first_(other.whole_word_first_),
      tokens_(std::move(other.tokens_)),
      merges_(std::move(other.merges_)),
      byte_ids_(other.byte_ids_) {}  // the cache starts empty

void BytePairEncoder::init_byte_ids() {
  for (int b = 0; b < 256; ++b) {
    const char c = static_cast<char>(b);
    auto it = tokens_.find(std::string_view(&c, 1));
    std::ostringstream hex;
    hex << "0x" << std::hex << std::setw(2) << std::setfill('0') << b;
    TITAN_USER_CHECK(it != tokens_.end(), "the BPE vocabulary has no token for the single byte ", hex.str(),
                     "; titan supports byte-level BPE vocabularies holding all 256 bytes (as GPT-2 and Llama 3 do)");
    byte_ids_[b] = it->second;
  }
}

bool BytePairEncoder::lookup(std::string_view word, size_t start, size_t mid, size_t end, int32_t left_id,
                             int32_t right_id, Merge& merge) const {
  if (use_merges_) {
    auto it = merges_.find(pair_key(left_id, right_id));
    if (it == merges_.end()) return false;
    merge = it->second;
    return true;
  }
  auto it = tokens_.find(word.substr(start, end - start));
  if (it == tokens_.end()) return false;
  merge = {it->second, it->second};
  return true;
}

void BytePairEncoder::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  // Symbols form a doubly linked list over the word's bytes; symbol i starts at byte i and a merged
  // symbol keeps its left part's index. Candidate merges wait in a min-heap ordered by (rank, start);
  // an entry is stale when either side changed since it was pushed (their lengths tell).
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    uint32_t len;  // 0 once merged into its left neighbour
  };
  struct Candidate {
    int32_t rank;
    uint32_t left;
    uint32_t left_len, right_len;
    int32_t id;
  };
  const auto n = static_cast<int32_t>(word.size());
  std::vector<Symbol> sym(n);
  for (int32_t i = 0; i < n; ++i) {
    sym[i] = {byte_ids_[static_cast<uint8_t>(word[i])], i - 1, i + 1 < n ? i + 1 : -1, 1};
  }
  auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.left > b.left;
  };
  std::vector<Candidate> heap;
  heap.reserve(n);
  auto push = [&](int32_t left) {
    const int32_t right = sym[left].next;
    if (right < 0) return;
    Merge m;
    if (lookup(word, left, right, right + sym[right].len, sym[left].id, sym[right].id, m)) {
      heap.push_back({m.rank, static_cast<uint32_t>(left), sym[left].len, sym[right].len, m.id});
      std::push_heap(heap.begin(), heap.end(), later);
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate c = heap.back();
    heap.pop_back();
    Symbol& left = sym[c.left];
    if (left.len != c.left_len || left.next < 0) continue;
    Symbol& right = sym[left.next];
    if (right.len != c.right_len) continue;
    left.id = c.id;
    left.len += right.len;
    right.len = 0;
    left.next = right.next;
    if (left.next >= 0) sym[left.next].prev = static_cast<int32_t>(c.left);
    if (left.prev >= 0) push(left.prev);
    push(static_cast<int32_t>(c.left));
  }
  for (int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
}

void BytePairEncoder::encode(std::string_view word, std::vector<int32_t>& out) const {
  TITAN_ASSERT(!word.empty());
  if (word.size() == 1) {
    out.push_back(byte_ids_[static_cast<uint8_t>(word[0])]);
    return;
  }
  if (whole_word_first_) {
    auto it = tokens_.find(word);
    if (it != tokens_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  CacheShard& shard = cache_[std::hash<std::string_view>{}(word) % kCacheShards];
  if (cacheable) {
    std::lock_guard<std::mutex> lock(shard.mutex);
    auto it = shard.words.find(word);
    if (it != shard.words.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  merge_word(word, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(shard.mutex);
    // Bounded memory; a shard refills with current words.
    if (shard.words.size() >= kMaxCacheEntries / kCacheShards) shard.words.clear();
    shard.words.emplace(std::string(word), std::vector<int32_t>(out.begin() + first, out.end()));
  }
}

}  // namespace titan::tokenizer
