// The training data loader: dataset names -> local files, the global sample stream, the split of each
// global batch over data-parallel ranks, and its checkpointable state. See docs/data.md.
//
// Rank partition: step s's global batch is samples [s*G, (s+1)*G) of the global stream (G =
// local_batch_size * dp_world), and rank r takes the contiguous slice [s*G + r*B, s*G + (r+1)*B). The
// ranks' batches concatenated in rank order are therefore exactly the batch one process reads with
// local_batch_size G, whatever dp_world is.
#pragma once

#include "titan/components/data/mixture.h"
#include "titan/components/data/text_windows.h"
#include "titan/components/data/window_source.h"
#include "titan/config/sections_run.h"
#include "titan/config/sections_train.h"
#include "titan/components/tokenizer/tokenizer.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace titan::dist {
class Group;
}

namespace titan::data {

struct DataConfig {
  std::string dataset = "c4_test";  // c4_test | c4 | c4_validation | titan_corpus (see resolve_dataset)
  std::string dataset_path;         // a file or folder; empty = the dataset's default
  std::vector<std::string> dataset_mix;  // a weighted mixture instead (mixture.h): "WEIGHT [NAME=]LOCATION [text_field=FIELD]"
  std::string text_field = "text";  // JSON field holding a document's text
  int64_t local_batch_size = 8;     // samples per rank per step
  int64_t seq_len = 2048;           // tokens per sample
  int dp_rank = 0;                  // this rank among the data-parallel ranks
  int dp_world = 1;                 // number of data-parallel ranks
  std::string section = "training"; // the config table errors name ("training" or "validation")
  TokenizeTogether together;        // text data: the processes sharing its tokenization (text_windows.h)
};

// Tokenization shared by the members of `group` (a Gloo host group: CPU tensors), which must outlive
// the data loaders using it.
TokenizeTogether tokenize_together(dist::Group& group);

// The [training] and [validation] sections' data options, for data-parallel rank dp_rank of dp_world.
DataConfig data_config(const config::Training& section, int dp_rank, int dp_world);
DataConfig data_config(const config::Validation& section, int dp_rank, int dp_world);

// One step's samples for this rank: int64 CPU tensors of shape (local_batch_size, seq_len);
// labels[b][t] = inputs[b][t+1] within the sample's window of seq_len + 1 tokens.
struct Batch {
  at::Tensor inputs;
  at::Tensor labels;
};

// Where a dataset's data is. `kind` is "text" (JSON Lines, Parquet, Arrow IPC, Hugging Face folders),
// "shards" (a folder of token shards), "megatron" or "llmc".
struct ResolvedDataset {
  std::string path;
  std::string kind;
  std::string split;  // "train" or "validation": which files of a folder with splits (list_data_files)
};

// Maps a dataset name and optional path to local data; nothing is downloaded:
//   c4_test       dataset_path, else assets/c4_test if present, else the bundled corpus
//   c4            dataset_path (required: a local copy of allenai/c4, its en/ folder, its Hugging Face cache
//                 folder datasets--allenai--c4, or any text data: JSON Lines, Parquet, Arrow IPC)
//   c4_validation dataset_path (required), the validation split of such a folder
//   titan_corpus  dataset_path, else the bundled corpus assets/corpus/corpus.jsonl.zst
// Relative asset paths are looked up in the current folder, then beside and above the titan binary.
// A dataset_path that is a folder holding manifest.json is read as token shards, whatever the name.
// Throws UserError for an unknown name or an absent path, saying what to pass.
// `section` is the config table whose keys the errors name (training.dataset_path, validation.dataset_path).
ResolvedDataset resolve_dataset(const std::string& name, const std::string& dataset_path,
                                const std::string& section = "training");

// The sources of a dataset_mix (see mixture.h), each resolved like dataset_path; errors name the source.
std::vector<std::pair<MixtureEntry, ResolvedDataset>> resolve_mixture(const std::vector<std::string>& entries,
                                                                      const std::string& section);

// Serves one data-parallel rank's batches. Not thread-safe.
class DataLoader {
 public:
  DataLoader(const DataConfig& config, std::unique_ptr<WindowSource> source, std::string description);

  // This rank's part of the next global batch. Never ends: the data repeats over epochs.
  Batch next();

  // The position after the batches read so far, as a small JSON object (text). It is the same on every
  // rank: it counts global samples, and the source position after the last global batch.
  std::string state() const;
  // Restores a state() of a loader over the same data and seq_len. The next batch then equals the one
  // the saving loader would have returned next (for the same dp_world and local_batch_size; another
  // layout continues the same global stream with its own split).
  void load_state(const std::string& state);

  // Samples of the global stream consumed so far (all ranks together).
  int64_t global_samples() const { return global_samples_; }
  // 0-based pass over the data of the next sample's first token.
  int64_t epoch() const { return source_->epoch(); }
  // For a mixture: the global stream's tokens (seq_len per sample) each source has served, by name.
  std::vector<std::pair<std::string, int64_t>> tokens_by_source() const;
  // E.g. "c4_test: text from assets/corpus/corpus.jsonl.zst", for the log.
  const std::string& description() const { return description_; }
  const DataConfig& config() const { return config_; }

 private:
  DataConfig config_;
  std::unique_ptr<WindowSource> source_;
  std::string description_;
  int64_t global_samples_ = 0;
  std::vector<int32_t> window_;
};

// Builds the loader for `config`: resolves the dataset, reads text with `tokenizer` or token shards
// checked against it. `tokenizer` must outlive the loader.
std::unique_ptr<DataLoader> make_dataloader(const DataConfig& config, const Tokenizer& tokenizer);

}  // namespace titan::data
