// Windows of the token stream of text data (JSON Lines, Parquet, Arrow IPC files), tokenized on the fly.
#pragma once

#include "titan/components/data/document_reader.h"
#include "titan/components/data/window_source.h"
#include "titan/components/tokenizer/tokenizer.h"

#include <deque>
#include <functional>
#include <vector>

namespace titan::data {

// Processes that read the same token stream (every rank of a run reads the same global sample
// stream; a node's ranks, say) and share its tokenization: each extracts and encodes 1/size of the
// documents, and the encodings are exchanged so that every member appends the whole stream in order.
struct TokenizeTogether {
  int rank = 0;  // this member's index
  int size = 1;  // members
  // Every member's `mine` (variable length), in member order. A collective over the members, called
  // by all of them at the same points (the stream advances alike on every member).
  std::function<std::vector<std::vector<int32_t>>(const std::vector<int32_t>& mine)> all_gather;
};

// Reads documents in file order, appends encode(text, add_bos=true, add_eos=true) to a token buffer and
// cuts windows from it; at the end of the last file it starts the next epoch at the first file, keeping
// the buffer's remainder.
//
// State: the position of the document holding the next unread token plus how many of the tokens from
// that document on were already consumed (plus the epoch). It stays a few integers however long the
// documents are; restoring it re-reads and re-tokenizes from that document on.
//
// With `together` of size > 1, documents are read in blocks (kDocsPerMember x size documents, at most
// kBlockBytes of lines, an exchange serving several steps): every member
// reads the block's lines, extracts (JSON) and encodes those of index rank, rank + size, ... and the
// block's encodings are exchanged (one all-gather of lengths, one of tokens). The stream, and so every
// window and state, is the one a single process reads. A member whose part fails (a bad line) sends
// its error instead: every member then throws it, none waits.
class TextWindowSource : public WindowSource {
 public:
  // A block: kDocsPerMember x size documents, or fewer when their lines reach kBlockBytes (the same
  // on every member: they read the same lines).
  static constexpr int64_t kDocsPerMember = 256;
  static constexpr size_t kBlockBytes = size_t{32} << 20;
  // `tokenizer` must outlive the source.
  TextWindowSource(std::vector<std::string> files, std::string text_field, const Tokenizer& tokenizer, int64_t seq_len,
                   TokenizeTogether together = {});

  void read(int32_t* out) override;
  void skip(int64_t n) override;
  int64_t window_len() const override { return window_len_; }
  int64_t epoch() const override;
  std::string kind() const override { return "text"; }
  nlohmann::json state() const override;
  void load_state(const nlohmann::json& state) override;

 private:
  void advance(int32_t* out);  // consumes window_len_ tokens, copying them to out when not null
  // Appends the next document's tokens (a block of them when tokenizing together), starting a new
  // epoch as needed.
  void read_document();
  // Reads the next line (a new epoch at the end of the files); the dataset's emptiness is an error.
  void next_line(std::string& line, DocPos& pos);
  void append(const DocPos& pos, const std::vector<int32_t>& ids);
  void pop_consumed();

  struct BufferedDoc {
    DocPos pos;
    int64_t num_tokens;
  };

  DocumentReader reader_;
  std::string files_digest_;  // of the files' names and sizes, in order: a saved state is of these files
  const Tokenizer& tokenizer_;
  int64_t window_len_;
  int64_t epoch_ = 0;                // epoch the reader is in
  DocPos next_;                      // position of the next document the reader returns
  std::deque<BufferedDoc> docs_;     // documents with tokens in buf_, in order
  std::vector<int32_t> buf_;         // their tokens, from buf_[base_] (first token of docs_.front())
  size_t base_ = 0;
  size_t head_ = 0;                  // next unread token of buf_
  int64_t pass_tokens_ = -1;         // tokens of the appended epoch when it was read from its start, else -1
  int64_t appended_epoch_ = 0;       // epoch of the last appended document
  int64_t pass_lines_ = -1;          // documents the reader returned in its epoch when read from its start, else -1
  TokenizeTogether together_;
  std::string text_;
};

}  // namespace titan::data
