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

#include "titan/components/data/token_files.h"
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
  // Threads that tokenize (0: one per core). The shards are the same, byte for byte, for any number.
  int workers = 0;
  // Process `process` of `processes` started together (titan launch): each tokenizes a contiguous run of
  // the sorted files (balanced by bytes) into shards named part-NNNNN-shard-NNNNN.bin; process 0 waits
  // for every part and writes the one manifest. The stream is the one process's.
  int process = 0;
  int processes = 1;
};

struct ShardWriteResult {
  int64_t num_documents = 0;
  int64_t num_tokens = 0;
  int64_t num_shards = 0;
  int workers = 1;  // threads that tokenized
  int64_t own_tokens = 0;  // tokens this process wrote (all of them for one process)
};

// Tokenizes every document of `input_path` (a JSON Lines, Parquet or Arrow file, or a folder of them,
// as the text data path reads it) with BOS and EOS and writes the shards and manifest.json to
// `out_dir`, which must be absent or empty. Throws UserError for bad input (see DocumentReader) or an unusable out_dir.
ShardWriteResult tokenize_to_shards(const std::string& input_path, const Tokenizer& tokenizer, const std::string& out_dir,
                                    const ShardWriteOptions& options = {});

// True when `path` is a folder holding manifest.json.
bool is_shard_folder(const std::string& path);

// Windows of a shard folder's token stream, read from memory maps (token_files.h). State: the number of
// windows read.
class ShardWindowSource : public MappedTokenSource {
 public:
  // Checks the folder against `tokenizer` (vocabulary size, BOS and EOS ids must match the manifest's).
  ShardWindowSource(const std::string& dir, const Tokenizer& tokenizer, int64_t seq_len);
};

}  // namespace titan::data
