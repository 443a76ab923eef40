// Windows of the token stream of text data (JSON Lines, Parquet, Arrow IPC files), tokenized on the fly.
#pragma once

#include "titan/components/data/document_reader.h"
#include "titan/components/data/window_source.h"
#include "titan/components/tokenizer/tokenizer.h"

#include <deque>
#include <vector>

namespace titan::data {

// Reads documents in file order, appends encode(text, add_bos=true, add_eos=true) to a token buffer and
// cuts windows from it; at the end of the last file it starts the next epoch at the first file, keeping
// the buffer's remainder.
//
// State: the position of the document holding the next unread token plus how many of the tokens from
// that document on were already consumed (plus the epoch). It stays a few integers however long the
// documents are; restoring it re-reads and re-tokenizes that one document.
class TextWindowSource : public WindowSource {
 public:
  // `tokenizer` must outlive the source.
  TextWindowSource(std::vector<std::string> files, std::string text_field, const Tokenizer& tokenizer, int64_t seq_len);

  void read(int32_t* out) override;
  void skip(int64_t n) override;
  int64_t window_len() const override { return window_len_; }
  int64_t epoch() const override;
  std::string kind() const override { return "text"; }
  nlohmann::json state() const override;
  void load_state(const nlohmann::json& state) override;

 private:
  void advance(int32_t* out);  // consumes window_len_ tokens, copying them to out when not null
  void read_document();        // appends the next document's tokens (starting a new epoch as needed)
  void pop_consumed();

  struct BufferedDoc {
    DocPos pos;
    int64_t num_tokens;
  };

  DocumentReader reader_;
  const Tokenizer& tokenizer_;
  int64_t window_len_;
  int64_t epoch_ = 0;                // epoch the reader is in
  DocPos next_;                      // position of the next document the reader returns
  std::deque<BufferedDoc> docs_;     // documents with tokens in buf_, in order
  std::vector<int32_t> buf_;         // their tokens, from buf_[base_] (first token of docs_.front())
  size_t base_ = 0;
  size_t head_ = 0;                  // next unread token of buf_
  int64_t pass_tokens_ = -1;         // tokens of the current epoch when it was read from its start, else -1
  std::string text_;
};

}  // namespace titan::data
