#include "titan/common/memory_snapshot.h"

#include "titan/common/error.h"
#include "titan/common/memory_tracker.h"

#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

// The CUDA allocator's history and snapshot live in libtorch_cuda. USE_C10D_NCCL is what
// CMakeLists.txt defines when libtorch is a CUDA build (so the symbols are there to link against);
// the header check keeps a libtorch without these headers building.
#if defined(USE_C10D_NCCL) && __has_include(<torch/csrc/cuda/memory_snapshot.h>)
#define TITAN_SNAPSHOT_HAS_CUDA 1
// torch::cuda::_record_memory_history and _memory_snapshot_pickled: internal API of PyTorch
// (the C++ side of torch.cuda.memory._record_memory_history / _snapshot), pinned to torch 2.11.
#include <torch/csrc/cuda/memory_snapshot.h>
#else
#define TITAN_SNAPSHOT_HAS_CUDA 0
#endif

namespace titan::mem {
namespace {

// Writes `contents` to `path` through a temporary file in the same folder and a rename (no fsync:
// these are diagnostics, not state to resume from). Creates the folders on the way.
void write_atomically(const std::string& path, const std::string& contents) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  std::error_code ec;
  if (target.has_parent_path()) {
    fs::create_directories(target.parent_path(), ec);
    TITAN_USER_CHECK(!ec, "memory snapshot: cannot create the folder ", target.parent_path().string(), ": ",
                     ec.message(), ". Check that the dump folder is writable.");
  }
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TITAN_USER_CHECK(out.is_open(), "memory snapshot: cannot open ", tmp, " for writing: ", std::strerror(errno),
                     ". Check that the dump folder is writable.");
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    out.close();
    if (!out) {
      fs::remove(tmp, ec);
      throw UserError("memory snapshot: writing " + path + " failed (" + std::to_string(contents.size()) +
                      " bytes): is the disk full?");
    }
  }
  fs::rename(tmp, target, ec);
  if (ec) {
    const std::string reason = ec.message();
    fs::remove(tmp, ec);
    throw UserError("memory snapshot: cannot rename " + tmp + " to " + path + ": " + reason);
  }
}

void check_cuda_supported(const char* what) {
  TITAN_USER_CHECK(TITAN_SNAPSHOT_HAS_CUDA, "memory snapshot: cannot ", what,
                   ": this build of titan has no CUDA support (libtorch without CUDA). Use a CUDA build of "
                   "libtorch, or turn CUDA memory snapshots off (--profiling.enable_memory_snapshot false).");
  TITAN_USER_CHECK(torch::cuda::is_available(), "memory snapshot: cannot ", what,
                   ": CUDA memory snapshots need a GPU, and CUDA sees none on this machine (no GPU or no "
                   "driver). Run on a machine with a GPU, or turn them off (--profiling.enable_memory_snapshot "
                   "false).");
}

}  // namespace

bool cuda_memory_history_supported() { return TITAN_SNAPSHOT_HAS_CUDA && torch::cuda::is_available(); }

void start_cuda_memory_history(size_t max_entries, bool cpp_stacks) {
  check_cuda_supported("record the CUDA allocator's history");
#if TITAN_SNAPSHOT_HAS_CUDA
  // enabled "all": every event goes to the ring buffer of `max_entries` (what the viewer's timelines
  // need). context: with C++ stacks, "all" (a stack for allocations, frees and the blocks' state);
  // without, none at all: a context without Python has no frames anyway, and skipping it saves an
  // object per event. stacks "python" gathers no C++ frames (and no Python ones here).
  using Option = std::optional<std::string>;
  if (cpp_stacks) {
    torch::cuda::_record_memory_history(Option("all"), Option("all"), "all", max_entries);
  } else {
    torch::cuda::_record_memory_history(Option("all"), std::nullopt, "python", max_entries);
  }
#endif
}

void stop_cuda_memory_history() {
  check_cuda_supported("stop the CUDA allocator's history");
#if TITAN_SNAPSHOT_HAS_CUDA
  torch::cuda::_record_memory_history(std::optional<std::string>(), std::nullopt, "python", 0);
#endif
}

void write_cuda_memory_snapshot(const std::string& path) {
  check_cuda_supported("write a CUDA memory snapshot");
#if TITAN_SNAPSHOT_HAS_CUDA
  write_atomically(path, torch::cuda::_memory_snapshot_pickled());
#endif
}

void write_cpu_memory_breakdown(const std::string& path, int64_t step) {
  const std::filesystem::path json_path = std::filesystem::path(path).replace_extension(".json");
  TITAN_ASSERT(json_path.string() != path, "the text breakdown's path ", path,
               " must not end in .json: the JSON goes beside it");
  const PeakBreakdown breakdown = cpu_peak_breakdown();
  std::string text = "step " + std::to_string(step) +
                     ": bytes of CPU tensors alive at the peak since the last reset, by the phase that allocated them\n";
  if (!cpu_tracking_installed()) text += "(CPU tensor tracking is not installed: no allocation was counted)\n";
  text += format_breakdown(breakdown);
  nlohmann::json json = breakdown_json(breakdown);
  json["step"] = step;
  write_atomically(path, text);
  write_atomically(json_path.string(), json.dump(2) + "\n");
}

}  // namespace titan::mem
