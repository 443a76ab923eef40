// titan's checkpoint format: a layout-free, sharded folder (docs/checkpoint.md).
//
//   step-N/
//     rank-00000.safetensors    the slices rank 0 writes (only real, unpadded parts; each replicated
//     rank-00000.slices.json    piece is written by one of its holders, balanced by bytes), and that
//     rank-00001.safetensors    file's own slice index: per tensor its dtype, global shape, offset,
//     rank-00001.slices.json    length and CRC-32
//     ...
//     index.json                written last by rank 0: per file its size and CRC-32; per global tensor
//                               its dtype, shape and the files holding its slices (as ranges of file
//                               numbers); the non-tensor state (train_state, lr_scheduler, dataloader, ...)
//
// Rank 0 learns only each rank's file sizes and checksums (one fixed-size record per rank, gathered by a
// collective); a reader opens index.json and only the slice indexes of the tensors it asks for.
// A folder is a checkpoint only once complete: files are written under step-N.partial/ and fsynced,
// index.json is written last, then the folder is renamed to step-N. Any layout and world size can read
// any checkpoint: each rank reads the blocks of each tensor it holds (Source::read). Version 1 folders
// (every slice listed in index.json) are still read.
#pragma once

#include "titan/components/checkpoint/source.h"
#include "titan/distributed/placement.h"

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

namespace titan::checkpoint {

class SafetensorsFile;

inline constexpr const char* kIndexFile = "index.json";
inline constexpr const char* kSlicesSuffix = ".slices.json";  // a data file's own slice index
inline constexpr int kFormatVersion = 2;

// How the ranks of a save agree, by collectives on a group of their own (a Gloo group whose timeout is
// checkpoint.save_timeout_seconds, usable from a background thread); a single process needs nothing.
// Every rank calls each method in the same order. A failure (a dead or stopped peer) throws.
class Coordinator {
 public:
  virtual ~Coordinator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Rank 0 returns every rank's `record` in rank order; the other ranks return {}. Records have the
  // same size on every rank.
  virtual std::vector<std::string> gather(const std::string& record) = 0;
  // Every rank returns rank 0's `message` (the others' argument is ignored).
  virtual std::string broadcast(const std::string& message) = 0;
};
std::unique_ptr<Coordinator> single_process_coordinator();

// One rank's part of a save: the real parts of the tensors this rank writes, contiguous. Copied to the
// CPU when training goes on while it is written; otherwise the live tensors themselves (a tensor on a
// GPU is then streamed to disk through a bounded host buffer).
struct Snapshot {
  struct Slice {
    std::string name;
    at::Tensor data;  // the real part (contiguous; on the CPU unless written synchronously)
    std::vector<int64_t> global_shape, begin;
    std::optional<at::ScalarType> store_as = std::nullopt;  // written in this dtype (cast while streamed)
    at::ScalarType stored_dtype() const { return store_as.value_or(data.scalar_type()); }
  };
  std::vector<Slice> slices;
  nlohmann::json state;  // non-tensor state written into the index by rank 0 (ignored elsewhere)
  nlohmann::json info;   // what the checkpoint is: {"step", "model": {...}, "contents": [...], "layout"}
};

struct SnapshotOptions {
  // Copy the data to the CPU (a background save: training goes on and changes the live tensors).
  // Without it, tensors are referenced, not copied (a save written before returning): CPU tensors
  // that need no conversion are written from where they are; device tensors, and tensors cast to
  // cast_floats_to, are streamed (and cast) in chunks through a bounded host buffer.
  bool copy = true;
  Snapshot* reuse = nullptr;  // the previous snapshot's buffers, overwritten in place (async_with_pinned_mem)
  bool pin = false;           // new buffers in pinned memory (CUDA only)
  std::optional<at::ScalarType> cast_floats_to;  // e.g. bfloat16 for a model-only export
};

// The real parts of the tensors of `tensors` this rank writes (placement.primary).
Snapshot take_snapshot(const std::vector<dist::PlacedTensor>& tensors, const SnapshotOptions& options = {});

// Chooses which holder of each replicated piece writes it, so that the holders write about the same
// bytes (greedy by bytes, largest first, as DCP's deduplicating planner does), and sets
// placement.primary accordingly. `member(dim)` gives this rank's index in mesh dimension `dim` and the
// dimension's size. Tensors without replicas keep their primary flag. Every holder of a piece computes
// the same choice from the same tensors, with no communication.
void assign_writers(std::vector<dist::PlacedTensor>& tensors,
                    const std::function<std::pair<int, int>(const std::string&)>& member);

// Writes `snap` as this rank's part of the checkpoint `step_dir` (e.g. ".../checkpoint/step-10"); rank 0
// then checks that it sees every rank's files, writes the index and makes the folder visible. Every
// rank of `coord` must call it, and it returns on every rank only once the save is complete everywhere
// (or throws on every rank, titan::UserError naming the path and the rank, when it is not). Returns the
// bytes this rank wrote. `rank0_before_index` runs on rank 0 once every rank has written its part,
// before the index; what it throws fails the save on every rank.
int64_t write(const std::string& step_dir, const Snapshot& snap, Coordinator& coord,
              const std::function<void()>& rank0_before_index = {});

// What rank 0 receives and reads to write the index of a save of `world` ranks (for the figures of
// docs/checkpoint.md): bytes gathered from the ranks, bytes of slice indexes read back, index bytes.
struct IndexCost {
  int64_t gathered_bytes = 0, slice_index_bytes_read = 0, index_bytes = 0;
};
IndexCost last_index_cost();  // of the last index this process wrote

// The metadata of a save of `world` ranks, without data (to measure it at scale on the meta device):
// rank r holds `slices_of(r)` (the tensors may be meta tensors; only names, dtypes and shapes count).
struct MetadataSimulation {
  std::vector<int64_t> slice_index_bytes;  // per rank: the slice index it writes
  IndexCost cost;                          // rank 0's
  std::string index;                       // index.json as rank 0 writes it
  double rank0_seconds = 0;                // rank 0's time to build the index from the records
};
MetadataSimulation simulate_metadata(int world, const std::function<std::vector<Snapshot::Slice>(int)>& slices_of);

// Writes whole tensors from one process (titan convert), fetching them one at a time by checkpoint
// name into files of at most max_file_bytes (part-00000.safetensors, ...): memory holds one file's worth.
void write_single_process(const std::string& step_dir, const std::vector<std::string>& names,
                          const std::function<at::Tensor(const std::string&)>& fetch, const nlohmann::json& info,
                          const nlohmann::json& state = nlohmann::json::object(), int64_t max_file_bytes = 2'000'000'000);
// The same for tensors already in memory.
void write_single_process(const std::string& step_dir, const std::map<std::string, at::Tensor>& tensors,
                          const nlohmann::json& info, const nlohmann::json& state = nlohmann::json::object());

// A complete checkpoint folder opened for reading. Throws UserError when `step_dir` has no index
// (incomplete or not a checkpoint) or the index is malformed or of another format version. Slice
// indexes are read (and verified) only when a tensor they hold is read.
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
  // Bytes of index.json and of the slice indexes read so far.
  int64_t index_bytes_read() const { return index_bytes_read_; }

 private:
  struct SliceRef {
    std::string file;
    std::vector<int64_t> begin, length;
    uint32_t crc32 = 0;
  };
  struct Entry {
    TensorMeta meta;
    std::vector<SliceRef> slices;  // version 1: listed in index.json
    std::vector<int64_t> shards;   // version 2: the data files (numbers) holding its slices
  };
  // The path of file `name` of the index, checked to exist with the size the index gives.
  std::string checked_path(const std::string& name) const;
  SafetensorsFile& file(const std::string& name);  // opened once, its size checked against the index
  const nlohmann::json& shard_index(int64_t shard);  // a data file's slice index, read and checked once
  std::vector<SliceRef> slices_of(const std::string& name, const Entry& e);
  std::string dir_;
  nlohmann::json index_;
  std::map<std::string, Entry> tensors_;
  std::vector<std::string> shards_;  // version 2: data file stems by number ("rank-00000")
  std::map<int64_t, nlohmann::json> shard_indexes_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;
  int64_t index_bytes_read_ = 0;
};

// Loading into the live tensors without a second copy of them: check() reads and verifies, for each of
// `tensors`, the block its placement covers (one block in memory at a time) and modifies nothing;
// once every rank's check has succeeded, load_into() reads the blocks again straight into the tensors.
// Both take the block from `source` by checkpoint name, check it against the global shape and dtype (a
// float dtype that differs is converted only when `allow_cast`) and throw UserError naming the tensor.
void check(Source& source, const std::vector<dist::PlacedTensor>& tensors, bool allow_cast);
void load_into(Source& source, const std::vector<dist::PlacedTensor>& tensors, bool allow_cast);

// The checkpoint folders step-N under `folder` that are complete (hold index.json), by step.
std::map<int64_t, std::string> list_checkpoints(const std::string& folder);

}  // namespace titan::checkpoint
