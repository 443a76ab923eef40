#include "titan/components/checkpoint/checkpointer.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/file_io.h"

#include <filesystem>
#include <regex>
#include <set>

namespace titan::checkpoint {
namespace fs = std::filesystem;
namespace {

class StoreCoordinator : public Coordinator {
 public:
  StoreCoordinator(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int world,
                   std::chrono::milliseconds timeout)
      : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), world_(world), timeout_(timeout) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::vector<std::string> gather_to_rank0(const std::string& key, const std::string& mine) override {
    const std::string base = prefix_ + "/" + key + "/";
    store_->set(base + std::to_string(rank_), std::vector<uint8_t>(mine.begin(), mine.end()));
    if (rank_ != 0) return {};
    std::vector<std::string> keys;
    for (int r = 0; r < world_; ++r) keys.push_back(base + std::to_string(r));
    try {
      store_->wait(keys, timeout_);
    } catch (const std::exception& e) {
      throw UserError("checkpoint: not every rank finished writing its part within " +
                      std::to_string(timeout_.count() / 1000) + " s (" + e.what() + "); the save is incomplete and "
                      "will be ignored");
    }
    std::vector<std::string> out;
    for (const auto& k : keys) {
      auto v = store_->get(k);
      out.emplace_back(v.begin(), v.end());
      store_->deleteKey(k);
    }
    return out;
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  int rank_, world_;
  std::chrono::milliseconds timeout_;
};

}  // namespace

std::unique_ptr<Coordinator> store_coordinator(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank,
                                               int world_size, std::chrono::milliseconds timeout) {
  return std::make_unique<StoreCoordinator>(std::move(store), std::move(prefix), rank, world_size, timeout);
}

Checkpointer::Checkpointer(const config::Checkpoint& cfg, std::string folder, std::unique_ptr<Coordinator> coord,
                           std::function<void(const std::string&)> log)
    : cfg_(cfg), folder_(std::move(folder)), coord_(std::move(coord)), log_(std::move(log)) {
  std::error_code ec;
  // Only a run that saves touches the folder: a load_only job beside a training job must not remove
  // that job's save in progress.
  if (coord_->rank() != 0 || !cfg_.enable || cfg_.load_only || !fs::is_directory(folder_, ec)) return;
  // A save that was interrupted (a crash or kill during the write) left step-N.partial; one that was
  // replacing an older folder of the same step may have left step-N.old without step-N; a deletion
  // by keep_latest_k, step-N.deleting.
  static const std::regex leftover(R"(^(step-\d+)\.(partial|old|deleting)$)");
  std::vector<fs::path> found;
  for (const auto& e : fs::directory_iterator(folder_, ec)) found.push_back(e.path());
  std::set<std::string> keep;  // leftovers of a step whose repair failed: left for the user to inspect
  for (const auto& path : found) {
    std::smatch m;
    const std::string name = path.filename().string();
    if (!std::regex_match(name, m, leftover) || m[2] != "old") continue;
    const std::string final_dir = (fs::path(folder_) / m[1].str()).string();
    const std::string done = recover_directory(final_dir + ".partial", final_dir, [](const std::string& d) {
      std::error_code e;
      return fs::exists(fs::path(d) / kIndexFile, e) || fs::exists(fs::path(d) / "config.json", e);
    });
    if (!done.empty()) log_("Checkpoint: " + done);
    if (!fs::exists(final_dir, ec)) keep.insert(m[1].str());
  }
  for (const auto& path : found) {
    std::smatch m;
    const std::string name = path.filename().string();
    if (!std::regex_match(name, m, leftover) || keep.count(m[1].str()) || !fs::exists(path, ec)) continue;
    fs::remove_all(path, ec);
    log_("Checkpoint: removed " + path.string() + ", left by a save or deletion that did not complete");
  }
}

Checkpointer::~Checkpointer() {
  try {
    wait();
  } catch (const std::exception& e) {
    log_(std::string("Checkpoint: the last save failed: ") + e.what());
  }
}

std::string Checkpointer::step_dir(int64_t step) const { return (fs::path(folder_) / ("step-" + std::to_string(step))).string(); }

std::optional<int64_t> Checkpointer::latest_step() const {
  auto all = list_checkpoints(folder_);
  if (all.empty()) return std::nullopt;
  return all.rbegin()->first;
}

bool Checkpointer::should_save(int64_t step, int64_t last_step) const {
  if (!cfg_.enable || cfg_.load_only) return false;
  return step % cfg_.interval == 0 || step == last_step || (step == 1 && cfg_.enable_first_step_checkpoint);
}

void Checkpointer::save(int64_t step, Snapshot snap) {
  wait();  // the previous save completes first (and its failure stops the run)
  const std::string dir = step_dir(step);
  if (cfg_.async_mode == "disabled") {
    SavingStep saving(step);
    write(dir, snap, *coord_);
    finish_save(step);
  } else {
    // The snapshot is owned by the worker; async_with_pinned_mem gets its buffers back afterwards.
    worker_ = std::thread([this, dir, step, snap = std::move(snap)]() mutable {
      try {
        SavingStep saving(step);
        write(dir, snap, *coord_);
        finish_save(step);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        error_ = std::current_exception();
      }
      if (cfg_.async_mode == "async_with_pinned_mem") {
        std::lock_guard<std::mutex> lock(mutex_);
        previous_ = std::move(snap);
      }
    });
  }
}

void Checkpointer::finish_save(int64_t step) {
  if (coord_->rank() != 0) return;
  log_("Checkpoint: saved step " + std::to_string(step) + " to " + step_dir(step));
  if (cfg_.keep_latest_k <= 0) return;
  // The newest k by step among this save and the older ones. Checkpoints of later steps (left by an
  // earlier run that this one resumed before, with load_step) are not this run's to delete.
  auto all = list_checkpoints(folder_);
  std::vector<std::string> older;
  for (const auto& [s, dir] : all)
    if (s < step) older.push_back(dir);
  const int64_t keep_older = cfg_.keep_latest_k - 1;
  for (int64_t i = 0; i + keep_older < static_cast<int64_t>(older.size()); ++i) {
    // Renamed first (atomic): a deletion cut short leaves step-N.deleting, removed by the next run.
    std::error_code ec;
    const std::string doomed = older[i] + ".deleting";
    fs::rename(older[i], doomed, ec);
    if (ec) fs::remove(fs::path(older[i]) / kIndexFile, ec);  // at least no longer a checkpoint
    fs::remove_all(ec ? older[i] : doomed, ec);
  }
}

void Checkpointer::wait() {
  if (worker_.joinable()) worker_.join();
  check();
}

void Checkpointer::check() {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::swap(e, error_);
  }
  if (!e) return;
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    throw UserError(std::string("a background checkpoint save failed, so the run stops: ") + ex.what());
  }
}

Snapshot* Checkpointer::reusable_snapshot() {
  if (cfg_.async_mode != "async_with_pinned_mem") return nullptr;
  if (worker_.joinable()) worker_.join();  // its buffers are ours again only when it is done
  return &previous_;
}

std::optional<int64_t> Checkpointer::resume_step() const {
  auto all = list_checkpoints(folder_);
  if (cfg_.load_step >= 0) {
    auto it = all.find(cfg_.load_step);
    std::string have;
    for (const auto& [s, d] : all) have += (have.empty() ? "" : ", ") + std::to_string(s);
    TITAN_USER_CHECK(it != all.end(), "checkpoint.load_step ", cfg_.load_step, ": ", folder_,
                     " has no complete checkpoint of that step (complete ones: ", have.empty() ? "none" : have, ")");
    if (all.rbegin()->first > cfg_.load_step)
      log_("Checkpoint: warning: " + folder_ + " also holds later steps (up to " + std::to_string(all.rbegin()->first) +
           ") that this run does not continue; a later run without load_step would resume from the latest of them");
    return it->first;
  }
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    Reader r(it->second);
    const auto& contents = r.info().at("contents");
    const bool full = std::find(contents.begin(), contents.end(), "train_state") != contents.end();
    if (full || it->first == 0) return it->first;
    log_("Checkpoint: " + it->second + " holds only the model (an export after the last step); not resuming from it");
  }
  return std::nullopt;
}

}  // namespace titan::checkpoint
