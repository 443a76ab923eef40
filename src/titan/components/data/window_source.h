// The global sample stream shared by every data-parallel rank.
//
// All documents, tokenized with BOS and EOS, form one token stream that repeats over the epochs
// without a break (the tokens left over at the end of an epoch are continued by the next epoch's first
// tokens). Sample k is the window of L = seq_len + 1 tokens at stream positions [k*L, (k+1)*L):
// consecutive windows do not overlap. inputs = window[:-1], labels = window[1:].
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace titan::data {

class WindowSource {
 public:
  virtual ~WindowSource() = default;
  // Writes the next window (window_len() tokens) to `out` and advances past it.
  virtual void read(int32_t* out) = 0;
  // Advances past the next `n` windows.
  virtual void skip(int64_t n) = 0;
  // Tokens per window (seq_len + 1).
  virtual int64_t window_len() const = 0;
  // The epoch (0-based pass over the data) of the next unread token.
  virtual int64_t epoch() const = 0;
  // "text" or "shards": the kind of state this source saves.
  virtual std::string kind() const = 0;
  // The position after the windows read so far, and its exact restoration (same data, same seq_len).
  virtual nlohmann::json state() const = 0;
  virtual void load_state(const nlohmann::json& state) = 0;
};

}  // namespace titan::data
