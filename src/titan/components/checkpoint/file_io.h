// Durable file I/O for checkpoints: safetensors files written with CRC-32s and fsync, read one
// tensor at a time with pread, and small files replaced atomically.
#pragma once

#include "titan/components/checkpoint/safetensors.h"
#include "titan/components/checkpoint/source.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace titan::checkpoint {

using safetensors::dtype_from_name;
using safetensors::dtype_name;

struct SafetensorsEntry {
  std::string name;
  at::Tensor data;  // contiguous; CPU tensors are written from where they are, others streamed
  std::optional<at::ScalarType> dtype = std::nullopt;  // stored as this (cast chunk by chunk while streamed)
  at::ScalarType stored_dtype() const { return dtype.value_or(data.scalar_type()); }
};

struct WriteOptions {
  // Tensors off the CPU (on a GPU), and tensors stored in another dtype, go to disk through one host
  // buffer of at most this many bytes, never a host copy of the whole tensor.
  int64_t host_buffer_bytes = 64 << 20;
  bool stream_cpu = false;  // stream CPU tensors through the buffer too (tests of the streamed path)
};

struct WrittenFile {
  int64_t bytes = 0;
  uint32_t crc32 = 0;                 // of the whole file
  std::vector<uint32_t> entry_crc32;  // of each entry's bytes, in the order given
};

// Writes `entries` as a safetensors file at `path`: to path + ".tmp", fsync, then renamed. Throws
// titan::UserError naming the path (and the system's reason) when it cannot be written.
WrittenFile write_safetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                              const std::map<std::string, std::string>& metadata, const WriteOptions& options = {});

// A safetensors file opened for reading single tensors (its header parsed once).
class SafetensorsFile {
 public:
  explicit SafetensorsFile(std::string path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  bool has(const std::string& name) const { return entries_.count(name) > 0; }
  // Every tensor's dtype and shape, and the header's __metadata__ (values that are not strings as JSON).
  std::map<std::string, TensorMeta> tensors() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The whole tensor `name` (a CPU tensor owning its memory). UserError naming the file when absent or unreadable.
  at::Tensor read(const std::string& name);
  const std::string& path() const { return path_; }

 private:
  struct Entry {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
    uint64_t begin, end;  // byte offsets in the file
  };
  std::string path_;
  int fd_ = -1;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

uint32_t tensor_crc32(const at::Tensor& t);  // CRC-32 (zlib's) of a contiguous CPU tensor's bytes
uint32_t file_crc32(const std::string& path);
uint32_t string_crc32(const std::string& text);

// Fault-injection points of a save (titan/common/fault_injection.h): "data" (half of a file written),
// "index" (every file written, no index yet), "rename" (index written, folder not yet renamed), as
// points checkpoint_<phase> of the step that the enclosing SavingStep names on this thread.
void crash_point(const char* phase);
class SavingStep {
 public:
  explicit SavingStep(int64_t step);
  ~SavingStep();

 private:
  int64_t previous_;
};

// Replaces `path` with `contents` atomically (temporary file, fsync, rename).
void write_file_atomically(const std::string& path, const std::string& contents);
// Makes the complete folder `from` visible as `to`: renamed into place, or, when `to` exists (a save
// of the same step again), `to` is first renamed to `to`.old, then removed once `from` is in place.
// A crash in between leaves `to`.old and `from`; recover_directory() puts the right one back.
void replace_directory(const std::string& from, const std::string& to);
// After a crash: `to` missing but `to`.old present: the new folder `from` is renamed into place when
// `complete(from)`, else `to`.old is restored. Returns what was done, or "" when nothing was needed.
std::string recover_directory(const std::string& from, const std::string& to,
                              const std::function<bool(const std::string&)>& complete);
// fsync of a folder, so that renames inside it survive a crash.
void sync_directory(const std::string& path);
std::string read_file(const std::string& path);

}  // namespace titan::checkpoint
