// torch.distributed.checkpoint (DCP) folders, as torchtitan saves them (step-N/):
//
//   .metadata          a Python pickle of DCP's Metadata: for every key its tensor dtype, global size
//                      and chunks (offsets, sizes), or "bytes" for a non-tensor value; for every
//                      chunk or value, the file, byte offset and length holding it
//   __0_0.distcp ...   one file per saving rank: each chunk or value is a torch.save blob
//
// torchtitan's keys: the model's parameters by name at the top level ("layers.0.attention.wq.weight"),
// the optimizer flattened ("optimizer.state.<param>.exp_avg", ".exp_avg_sq", ".step",
// "optimizer.param_groups.<param>.lr", ...), "lr_scheduler.last_epoch", "train_state.step" and
// "train_state.ntokens_seen", and the data loader's own state ("dataloader...."), which titan's data
// loader cannot use. The `.metadata` pickle is read by titan's own pickle reader (pickle.h: values
// only, no code runs); each chunk by LibTorch's reader of torch.save blobs.
//
// DcpSource presents such a folder under titan's checkpoint names (source.h): "model.<param>",
// "optimizer.<param>.exp_avg", "optimizer.<param>.exp_avg_sq", "optimizer.<param>.step", so that any
// layout loads it, each rank reading the blocks it holds from whichever chunks cover them.
#pragma once

#include "titan/components/checkpoint/source.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace titan::pickle {
class Writer;
}

namespace titan::checkpoint {

inline constexpr const char* kDcpMetadataFile = ".metadata";

// True when `dir` holds a DCP `.metadata` file.
bool is_dcp_folder(const std::string& dir);

// torch.save's zip format, streamed through `sink` (bytes, count -> count written): a data.pkl that
// rebuilds each tensor (torch._utils._rebuild_tensor_v2) from a storage record data/<k>, then the
// records, fetched one at a time (`fetch(i)`: entry i's data, a CPU tensor of its dtype and shape).
// `as_dict`: the pickle is a dict name -> tensor; else the one entry's tensor itself. An entry with
// `same_as` set shares that earlier entry's storage (a tied weight: written once, loaded as one).
struct TorchSaveEntry {
  std::string name;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  std::optional<size_t> same_as;
};
void write_torch_save(const std::function<size_t(const void*, size_t)>& sink, const std::vector<TorchSaveEntry>& entries,
                      bool as_dict, const std::function<at::Tensor(size_t)>& fetch);
// torch.save's archive around a pickle already made (data.pkl): storage record data/<i> for each i
// below `records` that `record(i)` returns (none for a Python object without tensors).
void write_torch_save_archive(const std::function<size_t(const void*, size_t)>& sink, const std::string& pickled,
                              size_t records, const std::function<std::optional<at::Tensor>(size_t)>& record);

// Writes a torch.distributed.checkpoint folder from one process: every tensor added whole, as one
// chunk (a torch.save blob, as DCP's FileSystemWriter writes them) in __0_0.distcp, and `.metadata`
// (DCP's Metadata dataclasses, pickled) by finish(). torch.distributed.checkpoint.load reads it into
// a state dict with those keys in any layout, as torchtitan's checkpoint.initial_load_path does.
class DcpWriter {
 public:
  // `dir` must not exist; it is made, and removed again if the writer ends before finish().
  explicit DcpWriter(std::string dir);
  ~DcpWriter();
  // One tensor under its DCP key (e.g. torchtitan's "layers.0.attention.wq.weight"); written at once
  // (streamed: no second copy of it in memory).
  void add(const std::string& key, const at::Tensor& tensor) { add(std::vector<std::string>{key}, tensor); }
  // One tensor of a nested state dict: `path` leads to it ({"optimizer", "state.<param>.exp_avg"}); its
  // key is the path joined with '.', as dcp.save flattens nested dicts.
  void add(const std::vector<std::string>& path, const at::Tensor& tensor);
  // A value that is not a tensor (DCP's bytes item: a torch.save of the Python object that `write`
  // pickles, e.g. a float, a tuple, a list).
  void add_object(const std::vector<std::string>& path, const std::function<void(pickle::Writer&)>& write);
  // `key` names the bytes of `existing` (added before) too: a tied weight, stored once.
  void add_alias(const std::string& key, const std::string& existing) { add_alias(std::vector<std::string>{key}, existing); }
  void add_alias(const std::vector<std::string>& path, const std::string& existing);
  // Writes `.metadata`: until then the folder is not a checkpoint.
  void finish();

 private:
  struct Item {
    std::string key;
    std::vector<std::string> path;
    bool object = false;  // a bytes item (no dtype or shape)
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    int64_t offset = 0, length = 0;
  };
  // Writes one blob (`write` streams it into the sink it is given) at the end of the data file.
  void append(Item item, const std::function<void(const std::function<size_t(const void*, size_t)>&)>& write);

  std::string dir_;
  std::unique_ptr<std::ofstream> data_;
  int64_t written_ = 0;
  std::vector<Item> items_;
  bool finished_ = false;
};

class DcpSource : public Source {
 public:
  // Reads and checks `.metadata`. Throws UserError naming the folder when it is missing, unreadable
  // or not DCP metadata, or when a chunk's file is missing or shorter than the metadata says.
  explicit DcpSource(std::string dir);
  ~DcpSource() override;

  std::vector<std::string> names() const override;
  std::optional<TensorMeta> meta(const std::string& name) const override;
  // Assembles the block from the chunks that cover it (each chunk's blob read and checked against its
  // dtype and size; the last chunk read is kept, so a tensor read block by block reads each chunk once).
  at::Tensor read(const std::string& name, const std::vector<int64_t>& begin,
                  const std::vector<int64_t>& length) override;
  std::string describe() const override { return "torch.distributed.checkpoint folder " + dir_; }

  // titan's parts the folder holds: "model", "optimizer", "lr_scheduler", "train_state" (in that order).
  std::vector<std::string> contents() const;
  // {"train_state": {"step", "ntokens_seen", "dp_degree"}, "lr_scheduler": {"step"}} for the parts it
  // holds (dp_degree: the degree the count was multiplied by, see below).
  // torchtitan records the tokens seen by one rank: titan's global count is that times the saving
  // run's data-parallel degree, which its data loader records ("dataloader.dp_world_size", before
  // 2026-08 "dataloader.world_size"); a folder without it (a data loader that did not save one, or
  // saved something else under that key) is taken to have `dp_degree_if_unrecorded`. Exact without
  // context parallelism (torchtitan from 2026-04 counts a rank's part of a sequence split over
  // context-parallel ranks).
  nlohmann::json state(int64_t dp_degree_if_unrecorded);
  // The optimizer's hyperparameters as saved (from the first parameter's group): lr, eps,
  // weight_decay, beta1, beta2, initial_lr (the base lr under a schedule), and as 1 or 0
  // decoupled_weight_decay (AdamW), fused and foreach: those present.
  std::map<std::string, double> optimizer_hyperparameters();
  // The data files the metadata names (one per saving rank).
  int64_t num_files() const;
  // Keys titan does not read, summarized by their first component ("dataloader (3 keys), ...").
  std::string unread_summary() const;

 private:
  struct Chunk {
    std::vector<int64_t> offsets, sizes;
    std::string file;
    int64_t offset = 0, length = 0;
  };
  struct Entry {
    std::string key;  // the DCP key
    TensorMeta meta;
    std::vector<Chunk> chunks;
  };
  struct Blob {
    std::string file;
    int64_t offset = 0, length = 0;
  };
  std::vector<char> read_bytes(const std::string& file, int64_t offset, int64_t length, const std::string& what);
  at::Tensor load_chunk(const Entry& e, const Chunk& c);
  std::optional<double> scalar(const std::string& key);  // a non-tensor value (or a 0-d tensor) that is a number
  bool has_value(const std::string& key) const { return values_.count(key) || scalar_tensors_.count(key); }

  std::string dir_;
  std::map<std::string, Entry> tensors_;   // by titan name
  std::map<std::string, Blob> values_;     // non-tensor items by DCP key
  std::map<std::string, Entry> scalar_tensors_;  // step counters saved as 0-d tensors, by DCP key
  std::vector<std::string> unread_;        // DCP keys titan does not map
  std::string cached_key_;                 // "<file>:<offset>" of the last chunk read
  at::Tensor cached_;
};

}  // namespace titan::checkpoint
