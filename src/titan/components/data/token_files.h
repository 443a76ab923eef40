// Pre-tokenized data memory-mapped as one token stream: titan's own shards (token_shards.h), Megatron-LM's
// indexed datasets and llm.c's token files. Every rank maps the same files; a window is found in
// O(log files), so skipping the other ranks' windows costs nothing. The stream is the files' tokens in
// order, as they are: the file's maker chose the document separators (Megatron's EOD, llm.c's
// <|endoftext|> or BOS before each document).
//
// Megatron-LM indexed dataset (MMIDIDX): PREFIX.idx and PREFIX.bin, little-endian.
//   .idx: bytes 0..8 "MMIDIDX\0\0", uint64 version (1), uint8 dtype code (1 uint8, 2 int8, 3 int16,
//         4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), uint64 sequence count S, uint64
//         document count D, int32 sequence lengths [S], int64 sequence byte offsets into .bin [S],
//         int64 document indices [D] (the sequences where documents start; the last is S).
//   .bin: the sequences' tokens, back to back.
// llm.c token file (dev/data/data_common.py): int32 header [256] = {magic, version, token count, 0...},
//   then the tokens: magic 20240520 version 1 (GPT-2): uint16; magic 20240801 version 7 (Llama 3): uint32.
#pragma once

#include "titan/components/data/window_source.h"

#include <cstdint>
#include <string>
#include <vector>

namespace titan::data {

enum class TokenType : uint8_t { U8, I8, I16, U16, I32, U32, I64 };
int64_t token_bytes(TokenType t);
const char* token_type_name(TokenType t);

// The windows of a sequence of memory-mapped token segments, one stream repeated over the epochs.
// Every token read is checked against the vocabulary. State: windows read and the stream's length.
class MappedTokenSource : public WindowSource {
 public:
  ~MappedTokenSource() override;
  MappedTokenSource(const MappedTokenSource&) = delete;
  MappedTokenSource& operator=(const MappedTokenSource&) = delete;

  void read(int32_t* out) override;
  void skip(int64_t n) override { windows_ += n; }
  int64_t window_len() const override { return window_len_; }
  int64_t epoch() const override { return windows_ * window_len_ / total_tokens_; }
  std::string kind() const override { return kind_; }
  nlohmann::json state() const override;
  void load_state(const nlohmann::json& state) override;

  int64_t num_tokens() const { return total_tokens_; }
  int64_t num_files() const { return static_cast<int64_t>(segments_.size()); }

 protected:
  // kind: the state's kind ("shards", "megatron", "llmc"); what: how errors name a file ("token shard").
  MappedTokenSource(std::string kind, std::string what, int64_t seq_len, int64_t vocab_size);
  // Maps the whole file read-only; the map lives as long as this source. Throws UserError naming it.
  struct Mapped {
    const char* data = nullptr;
    size_t bytes = 0;
  };
  Mapped map_file(const std::string& path);
  // Appends `num_tokens` tokens of `type` at `tokens` (inside a map of map_file) to the stream.
  void add_segment(const std::string& path, const char* tokens, TokenType type, int64_t num_tokens);
  // After the last add_segment: the stream must hold a token.
  void finish(const std::string& source);

  int64_t vocab_size() const { return vocab_size_; }

 private:
  struct Segment {
    std::string path;
    const char* tokens = nullptr;
    TokenType type = TokenType::U32;
    int64_t num_tokens = 0;
    int64_t start = 0;  // stream position of its first token within an epoch
  };
  std::string kind_, what_;
  std::vector<Mapped> maps_;
  std::vector<Segment> segments_;
  int64_t total_tokens_ = 0;
  int64_t window_len_;
  int64_t vocab_size_;
  int64_t windows_ = 0;  // windows read or skipped so far
};

// Whether `path` exists, is a Megatron prefix (PREFIX.idx exists), or as a shell pattern (*, ?, [)
// matches a file.
bool names_existing_data(const std::string& path);

// What kind of pre-tokenized data `path` is: "shards" (a folder with manifest.json), "megatron" (a
// PREFIX with PREFIX.idx and PREFIX.bin, either file, or a folder of such pairs), "llmc" (an llm.c .bin
// file or a folder of them), or "" (none: text).
std::string token_file_kind(const std::string& path);

// Megatron-LM indexed datasets: the prefixes' sequences in order (a folder: its .idx files' prefixes,
// sorted by name). The file's token type must be the one Megatron picks for this vocabulary (uint16
// below 65,500 tokens, int32 above), so a file made with another tokenizer is refused.
class MegatronWindowSource : public MappedTokenSource {
 public:
  MegatronWindowSource(const std::string& path, int64_t vocab_size, int64_t seq_len);
  int64_t num_documents() const { return num_documents_; }

 private:
  int64_t num_documents_ = 0;
};

// llm.c token files: the file, a folder's .bin files or a pattern's, sorted by name. GPT-2 files (uint16
// ids) are refused for a vocabulary that uint16 cannot hold.
class LlmcWindowSource : public MappedTokenSource {
 public:
  LlmcWindowSource(const std::string& path, int64_t vocab_size, int64_t seq_len);
};

// The Megatron prefixes, or llm.c files, that `path` names (see the classes above), sorted. `path` may be
// a shell pattern (llm.c's "fineweb10B/fineweb_train_*.bin"; for Megatron, of .idx or .bin files).
std::vector<std::string> megatron_prefixes(const std::string& path);
std::vector<std::string> llmc_files(const std::string& path);

}  // namespace titan::data
