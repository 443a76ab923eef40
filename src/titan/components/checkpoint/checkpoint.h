// titan's checkpoint format: a layout-free, sharded folder (docs/checkpoint.md).
//
//   step-N/
//     rank-00000.safetensors   the slices rank 0 owns (only the real, unpadded parts; replicas
//     rank-00001.safetensors   (HSDP/DDP copies) are written by one rank only); plain safetensors
//     ...                      files whose __metadata__ says where each slice sits in its tensor
//     index.json               written last: per global tensor its dtype, global shape and slices
//                              (file, offset, length, CRC-32), per file its size and CRC-32, and
//                              the non-tensor state (train_state, lr_scheduler, dataloader, ...)
//
// A folder is a checkpoint only once complete: files are written under step-N.partial/ and
// fsynced, index.json is written last, then the folder is renamed to step-N. Any layout and world
// size can read any checkpoint: each rank reads the blocks of each tensor it holds (Source::read).
#pragma once

#include "titan/components/checkpoint/source.h"
#include "titan/distributed/placement.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace titan::checkpoint {

class SafetensorsFile;

inline constexpr const char* kIndexFile = "index.json";
inline constexpr int kFormatVersion = 1;

// How the ranks of a save agree: every rank publishes its file's description and rank 0 collects
// them all (through the TCP store, usable from a background thread). A single process needs nothing.
class Coordinator {
 public:
  virtual ~Coordinator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Rank 0: returns every rank's `mine` in rank order (waiting for them); other ranks: returns {}.
  // `key` names this exchange and must be unique per save.
  virtual std::vector<std::string> gather_to_rank0(const std::string& key, const std::string& mine) = 0;
};
std::unique_ptr<Coordinator> single_process_coordinator();

// One rank's part of a save: the real parts of the primary tensors, CPU, contiguous; copied off the
// live training state when training goes on while it is written.
struct Snapshot {
  struct Slice {
    std::string name;
    at::Tensor data;  // the real part (CPU, contiguous)
    std::vector<int64_t> global_shape, begin;
  };
  std::vector<Slice> slices;
  nlohmann::json state;  // non-tensor state written into the index by rank 0 (ignored elsewhere)
  nlohmann::json info;   // what the checkpoint is: {"step", "model": {...}, "contents": [...], "layout"}
};

struct SnapshotOptions {
  // Copy the data (a background save: training goes on and changes the live tensors). Without it,
  // CPU tensors that need no conversion are referenced, not copied (a save written before returning).
  bool copy = true;
  Snapshot* reuse = nullptr;  // the previous snapshot's buffers, overwritten in place (async_with_pinned_mem)
  bool pin = false;           // new buffers in pinned memory (CUDA only)
  std::optional<at::ScalarType> cast_floats_to;  // e.g. bfloat16 for a model-only export
};

// The real parts of the primary tensors of `tensors`, on the CPU, contiguous.
Snapshot take_snapshot(const std::vector<dist::PlacedTensor>& tensors, const SnapshotOptions& options = {});

// Writes `snap` as this rank's part of the checkpoint `step_dir` (e.g. ".../checkpoint/step-10"); rank 0
// then writes the index and makes the folder visible. Every rank of `coord` must call it. Throws
// titan::UserError (naming the path) when something cannot be written. Returns bytes this rank wrote.
int64_t write(const std::string& step_dir, const Snapshot& snap, Coordinator& coord);

// Writes whole tensors from one process (titan convert), fetching them one at a time by checkpoint
// name into files of at most max_file_bytes (part-00000.safetensors, ...): memory holds one file's worth.
void write_single_process(const std::string& step_dir, const std::vector<std::string>& names,
                          const std::function<at::Tensor(const std::string&)>& fetch, const nlohmann::json& info,
                          const nlohmann::json& state = nlohmann::json::object(), int64_t max_file_bytes = 2'000'000'000);
// The same for tensors already in memory.
void write_single_process(const std::string& step_dir, const std::map<std::string, at::Tensor>& tensors,
                          const nlohmann::json& info, const nlohmann::json& state = nlohmann::json::object());

// A complete checkpoint folder opened for reading. Throws UserError when `step_dir` has no index
// (incomplete or not a checkpoint) or the index is malformed or of another format version.
class Reader : public Source {
 public:
  explicit Reader(std::string step_dir);
  ~Reader() override;
  std::vector<std::string> names() const override;
  std::optional<TensorMeta> meta(const std::string& name) const override;
  at::Tensor read(const std::string& name, const std::vector<int64_t>& begin,
                  const std::vector<int64_t>& length) override;
  std::string describe() const override { return "checkpoint " + dir_; }

  const std::string& dir() const { return dir_; }
  const nlohmann::json& info() const { return index_.at("info"); }    // step, model, contents, layout
  const nlohmann::json& state() const { return index_.at("state"); }  // non-tensor state
  // Checks every file's size and CRC-32 against the index (reads everything). Throws naming the file.
  void verify_all();

 private:
  SafetensorsFile& file(const std::string& name);  // opened once, its size checked against the index
  std::string dir_;
  nlohmann::json index_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
};

// What to do with each local tensor when loading: read its block into a staging tensor first, so that
// a failure anywhere modifies nothing.
struct Staged {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (destination, staged value)
  void apply();  // copies every staged value into its destination
};

// Reads, for each of `tensors`, the block its placement covers from `source` (name = its checkpoint
// name), checked against its global shape and dtype. A float dtype that differs is converted only
// when `allow_cast`. Throws UserError naming the tensor (missing, other shape or dtype).
Staged stage(Source& source, const std::vector<dist::PlacedTensor>& tensors, bool allow_cast);

// The checkpoint folders step-N under `folder` that are complete (hold index.json), by step.
std::map<int64_t, std::string> list_checkpoints(const std::string& folder);

}  // namespace titan::checkpoint
