// Pre-tokenized data: a folder of binary token shards, written once (`titan tokenize`), then
// memory-mapped by every rank. The token stream is the same as the text path's (documents in file order,
// each as BOS + tokens + EOS), so both serve identical windows.
//
// Folder layout:
//   manifest.json        written last: its presence marks a complete folder. Fields:
//                        format ("titan-token-shards"), version (1), num_tokens, num_documents,
//                        tokenizer {vocab_size, bos_id, eos_id, name}, text_field, sources [paths],
//                        shards [{file, num_tokens, num_documents}] in stream order.
//   shard-00000.bin ...  one file per shard, little-endian:
//     bytes  0..7    magic "TITANTOK"
//     bytes  8..11   uint32 format version (1)
//     bytes 12..15   uint32 bytes per token (4)
//     bytes 16..23   uint64 num_tokens (n)
//     bytes 24..31   uint64 num_documents (d)
//     bytes 32..39   uint64 vocab_size of the tokenizer
//     bytes 40..63   zero
//     bytes 64..     uint32 tokens[n]
//     then, at the next multiple of 8, uint64 doc_starts[d]: index within this shard of each
//     document's first token (documents never straddle shards).
#pragma once

#include "titan/components/data/window_source.h"
#include "titan/components/tokenizer/tokenizer.h"

#include <cstdint>
#include <string>
#include <vector>

namespace titan::data {

struct ShardWriteOptions {
  std::string text_field = "text";
  // A shard is closed after the document that brings it to at least this many tokens (4 bytes each).
  int64_t tokens_per_shard = int64_t{1} << 28;
  // Recorded in the manifest (e.g. the tokenizer's path), informational.
  std::string tokenizer_name;
  // allenai/c4 clone folders: which split's files to read (see list_data_files).
  std::string split = "train";
};

struct ShardWriteResult {
  int64_t num_documents = 0;
  int64_t num_tokens = 0;
  int64_t num_shards = 0;
};

// Tokenizes every document of `input_path` (a JSON Lines file or folder, as the text data path reads
// it) with BOS and EOS and writes the shards and manifest.json to `out_dir`, which must be absent or
// empty. Throws UserError for bad input (see JsonlReader) or an unusable out_dir.
ShardWriteResult tokenize_to_shards(const std::string& input_path, const Tokenizer& tokenizer, const std::string& out_dir,
                                    const ShardWriteOptions& options = {});

// True when `path` is a folder holding manifest.json.
bool is_shard_folder(const std::string& path);

// Windows of a shard folder's token stream, read from memory maps. Any window is found in O(log shards)
// time, so a rank skipping the other ranks' windows costs nothing. State: the number of windows read.
class ShardWindowSource : public WindowSource {
 public:
  // Checks the folder against `tokenizer` (vocabulary size, BOS and EOS ids must match the manifest's).
  ShardWindowSource(const std::string& dir, const Tokenizer& tokenizer, int64_t seq_len);
  ~ShardWindowSource() override;

  void read(int32_t* out) override;
  void skip(int64_t n) override { windows_ += n; }
  int64_t window_len() const override { return window_len_; }
  int64_t epoch() const override { return windows_ * window_len_ / total_tokens_; }
  std::string kind() const override { return "shards"; }
  nlohmann::json state() const override;
  void load_state(const nlohmann::json& state) override;

  int64_t num_tokens() const { return total_tokens_; }

 private:
  struct Shard {
    void* map = nullptr;
    size_t map_bytes = 0;
    const uint32_t* tokens = nullptr;
    int64_t num_tokens = 0;
    int64_t start = 0;  // stream position of tokens[0] within an epoch
    std::string path;
  };
  std::vector<Shard> shards_;
  int64_t total_tokens_ = 0;
  int64_t window_len_;
  uint64_t vocab_size_;  // every token read is checked against it
  int64_t windows_ = 0;  // windows read or skipped so far
};

}  // namespace titan::data
