// The checkpoint manager of a training run: when to save, where, in the foreground or background,
// how many to keep, which one to resume from, and the cleanup of saves that never completed.
// The format itself is checkpoint.h; what goes into a checkpoint is the trainer's business.
#pragma once

#include "titan/components/checkpoint/checkpoint.h"
#include "titan/config/sections_train.h"

#include <chrono>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

namespace titan::dist {
class Group;
}

namespace titan::checkpoint {

// Coordinates the ranks of a save by collectives on `group` (Gloo, with checkpoint.save_timeout_seconds
// as its timeout), apart from the training groups, so that it works from a background thread. A dead
// peer fails the collective at once (its connection closes), a stopped one after the timeout; the
// error names the ranks that did not arrive. With node_coordinator (the trainer's: the host groups
// "checkpoint_node" and "checkpoint_nodes") that holds within a node; a rank of another node is named
// by its node's first rank, and rank 0 sees that first rank's failure (its exit, or the timeout).
std::unique_ptr<Coordinator> group_coordinator(dist::Group& group);
// The same in two levels (Mesh::host_groups_by_block): `node`, this rank's block of consecutive
// ranks, and `nodes`, the blocks' first ranks (on those ranks; null elsewhere and with one block).
// A gather collects each block's records on its first rank, then those on rank 0; a broadcast goes
// the other way.
std::unique_ptr<Coordinator> node_coordinator(dist::Group& node, dist::Group* nodes, int rank, int world_size);

class Checkpointer {
 public:
  // folder: <dump_folder>/<checkpoint.folder>. In a run that saves, rank 0 repairs or removes what
  // interrupted saves and deletions left behind (never throws for that: it runs before ranks agree).
  Checkpointer(const config::Checkpoint& cfg, std::string folder, std::unique_ptr<Coordinator> coord,
               std::function<void(const std::string&)> log);
  ~Checkpointer();  // waits for a background save (errors are logged, not thrown)

  const std::string& folder() const { return folder_; }
  std::string step_dir(int64_t step) const;
  // The latest complete checkpoint in the folder, if any.
  std::optional<int64_t> latest_step() const;
  // Whether training step `step` (1-based) ends with a save: every interval steps, after the first step
  // with enable_first_step_checkpoint, and after the last step. Never with load_only or enable false.
  bool should_save(int64_t step, int64_t last_step) const;
  // Checks that every rank sees the checkpoint folder rank 0 sees (a file rank 0 writes there), so that
  // a folder on node-local disks is refused at start-up instead of being half-written at the first
  // save. Every rank must call it; throws UserError on every rank naming the folder and the ranks.
  // `override_folder`: this rank's view of the folder when it differs (a test hook; empty: folder()).
  void check_shared_folder(const std::string& override_folder = "");
  // Writes `snap` as step `step`: in the background with async_mode (after waiting for the previous
  // save), else before returning, once complete on every rank. Keeps the newest keep_latest_k
  // checkpoints. A folder of that step holding a model-only or Hugging Face export is moved aside
  // (step-N.export), with a log line, rather than replaced by a save of the full state.
  void save(int64_t step, Snapshot snap);
  // Waits for the background save (and rank 0's deletion of older checkpoints), rethrowing its
  // failure as a UserError.
  void wait();
  // Rethrows the failure of a finished background save, if any (called every step).
  void check();
  // Buffers of the previous snapshot, to be reused by async_with_pinned_mem (null otherwise).
  Snapshot* reusable_snapshot();

  // The step (its folder's name) to resume from: load_step's, else the latest complete checkpoint
  // holding training state (model-only exports after the last step are not resumed from; a step-0
  // seed is), or nullopt.
  std::optional<int64_t> resume_step() const;

 private:
  void write_step(int64_t step, const Snapshot& snap);  // the save itself, in the saving thread
  void finish_save(int64_t step);  // rank 0: keep_latest_k
  void keep_export(int64_t step, const Snapshot& snap);  // rank 0: moves an export of `step` aside
  config::Checkpoint cfg_;
  std::string folder_;
  std::unique_ptr<Coordinator> coord_;
  std::function<void(const std::string&)> log_;
  std::thread worker_;
  // rank 0: removes the checkpoints keep_latest_k let go (renamed step-N.deleting first), while the
  // other ranks train on; joined before the next one starts and by wait().
  std::thread deleter_;
  std::mutex mutex_;
  std::exception_ptr error_;
  Snapshot previous_;
};

}  // namespace titan::checkpoint
