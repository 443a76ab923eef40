// Memory snapshots, the files written to <dump_folder>/memory_snapshot/:
//
// CUDA: the caching allocator's record of allocations and frees, and its segments and blocks now, as
//   torch.cuda.memory._record_memory_history() and _dump_snapshot() write them: a pickle that
//   https://pytorch.org/memory_viz opens (Active Memory Timeline, Allocator State History). Stack
//   traces are off by default: without Python there are no Python frames, and C++ frames cost an
//   unwind of the stack on every allocation and free; the viewer then shows each block with
//   "<block was allocated before _record_history was enabled>" in place of its stack.
// CPU: the peak breakdown of the counting CPU allocator (memory_tracker.h): which phase of training
//   allocated the bytes alive at the peak, as a small table and as JSON.
//
// Every file is written to a temporary name beside it and renamed into place, so a reader never sees
// half a file; missing folders are created. Two threads must not write the same path at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace titan::mem {

// True in a CUDA build of titan on a machine where CUDA sees a GPU.
bool cuda_memory_history_supported();

// Starts recording the CUDA caching allocator's history on every device: the last `max_entries`
// allocations, frees and segment (de)allocations, as
// torch.cuda.memory._record_memory_history(max_entries=...) does. `cpp_stacks` records the C++
// stack of each event (slow: an unwind per allocation, symbolized when the snapshot is written).
// Calling it again while recording changes the settings and keeps what was recorded.
// Throws titan::UserError, saying what to do, when !cuda_memory_history_supported().
void start_cuda_memory_history(size_t max_entries, bool cpp_stacks = false);

// Stops recording and discards the recorded history (as PyTorch does): write the snapshot first.
// Throws titan::UserError when !cuda_memory_history_supported().
void stop_cuda_memory_history();

// Writes the snapshot (torch::cuda::_memory_snapshot_pickled(): segments, blocks, and the history
// recorded so far) to `path`, e.g. <dump_folder>/memory_snapshot/iteration_10/rank0_memory_snapshot.pickle.
// Without a history being recorded it holds the segments and blocks only. Throws titan::UserError
// when !cuda_memory_history_supported() or the file cannot be written.
void write_cuda_memory_snapshot(const std::string& path);

// Writes cpu_peak_breakdown() (the window since the last reset_cpu_peak()) for training step `step`
// twice: as text to `path` (format_breakdown() under a line naming the step), and as JSON to `path`
// with its extension replaced by ".json" ({"step": N, "peak_bytes": ..., "phase_at_peak": ...,
// "alive_by_phase": {...}}), e.g. rank0_cpu_memory.txt and rank0_cpu_memory.json. `path` must not
// itself end in ".json". Works without a GPU. Throws titan::UserError when a file cannot be written.
void write_cpu_memory_breakdown(const std::string& path, int64_t step);

}  // namespace titan::mem
