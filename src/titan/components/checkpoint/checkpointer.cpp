#include "titan/components/checkpoint/checkpointer.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/file_io.h"
#include "titan/distributed/mesh.h"

#include <ATen/ATen.h>

#include <cstring>
#include <random>

#include <filesystem>
#include <regex>
#include <set>
#include <thread>

namespace titan::checkpoint {
namespace fs = std::filesystem;
namespace {

class GroupCoordinator : public Coordinator {
 public:
  explicit GroupCoordinator(dist::Group& group) : group_(group) {}
  int rank() const override { return group_.rank(); }
  int world_size() const override { return group_.size(); }
  std::vector<std::string> gather(const std::string& record) override {
    const auto n = static_cast<int64_t>(record.size());
    at::Tensor in = at::empty({n}, at::kByte);
    std::memcpy(in.data_ptr(), record.data(), record.size());
    at::Tensor out = at::empty({rank() == 0 ? n * world_size() : 0}, at::kByte);
    group_.gather(out, in, 0).wait();
    if (rank() != 0) return {};
    std::vector<std::string> all;
    for (int r = 0; r < world_size(); ++r) all.emplace_back(static_cast<const char*>(out.data_ptr()) + r * n, n);
    return all;
  }
  std::string broadcast(const std::string& message) override {
    at::Tensor size = at::full({1}, rank() == 0 ? static_cast<int64_t>(message.size()) : 0, at::kLong);
    group_.broadcast(size, 0).wait();
    const int64_t n = size.item<int64_t>();
    if (n == 0) return "";
    at::Tensor data = at::empty({n}, at::kByte);
    if (rank() == 0) std::memcpy(data.data_ptr(), message.data(), message.size());
    group_.broadcast(data, 0).wait();
    return std::string(static_cast<const char*>(data.data_ptr()), static_cast<size_t>(n));
  }

 private:
  dist::Group& group_;
};

class NodeCoordinator : public Coordinator {
 public:
  NodeCoordinator(dist::Group& node, dist::Group* nodes, int rank, int world_size)
      : node_(node), nodes_(nodes && nodes->size() > 1 ? nodes : nullptr), rank_(rank), world_(world_size) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::vector<std::string> gather(const std::string& record) override {
    std::vector<std::string> local = GroupCoordinator(node_).gather(record);
    if (node_.rank() != 0) return {};
    if (!nodes_) return local;
    // The block's records as one, padded to a whole block (the last block may be shorter): block
    // k's first rank is k x the block size.
    const size_t n = record.size();
    const int block = nodes_->rank() == 0 ? node_.size() : rank_ / nodes_->rank();
    std::string blob;
    for (const auto& r : local) blob += r;
    blob.resize(n * static_cast<size_t>(block), '\0');
    const std::vector<std::string> blobs = GroupCoordinator(*nodes_).gather(blob);
    if (nodes_->rank() != 0) return {};
    std::vector<std::string> all;
    for (const auto& b : blobs)
      for (int i = 0; i < block && static_cast<int>(all.size()) < world_; ++i) all.push_back(b.substr(i * n, n));
    return all;
  }
  std::string broadcast(const std::string& message) override {
    std::string m = message;
    if (nodes_ && node_.rank() == 0) m = GroupCoordinator(*nodes_).broadcast(m);
    return GroupCoordinator(node_).broadcast(m);
  }

 private:
  dist::Group& node_;
  dist::Group* nodes_;
  int rank_, world_;
};

}  // namespace

std::unique_ptr<Coordinator> group_coordinator(dist::Group& group) { return std::make_unique<GroupCoordinator>(group); }
std::unique_ptr<Coordinator> node_coordinator(dist::Group& node, dist::Group* nodes, int rank, int world_size) {
  return std::make_unique<NodeCoordinator>(node, nodes, rank, world_size);
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

void Checkpointer::check_shared_folder(const std::string& override_folder) {
  const std::string mine = override_folder.empty() ? folder_ : override_folder;
  // A name of its own per run: a quick restart never finds (or is misled by) an earlier run's file.
  std::string name, probe_error;
  if (coord_->rank() == 0) {
    try {
      std::error_code ec;
      fs::create_directories(folder_, ec);
      TITAN_USER_CHECK(!ec, "cannot create the checkpoint folder ", folder_, ": ", ec.message(),
                       " (check checkpoint.folder and job.dump_folder, and that the disk is writable)");
      name = ".titan-shared-folder-check-" + std::to_string(std::random_device{}()) + "-" +
             std::to_string(std::random_device{}());
      write_file_atomically((fs::path(folder_) / name).string(), name);
      sync_directory(folder_);
    } catch (const std::exception& e) {
      probe_error = e.what();
    }
  }
  name = coord_->broadcast(probe_error.empty() ? name : "\n" + probe_error);
  if (!name.empty() && name[0] == '\n') throw UserError(name.substr(1));
  // What this rank sees, retried for a few seconds (network file systems may show a new file late).
  std::string seen;
  const fs::path probe = fs::path(mine) / name;
  for (int attempt = 0; attempt < 20; ++attempt) {
    try {
      std::error_code ec;
      if (!fs::exists(probe, ec)) seen = ec ? "cannot look into the folder (" + ec.message() + ")" : "does not see the file";
      else seen = read_file(probe.string()) == name ? "" : "sees another content in the file";
    } catch (const std::exception& e) {
      seen = std::string("cannot read the file (") + e.what() + ")";
    }
    if (seen.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
  std::string record(200, '\0');
  std::memcpy(record.data(), seen.data(), std::min(seen.size(), record.size() - 1));
  const auto all = coord_->gather(record);
  std::string outcome;
  if (coord_->rank() == 0) {
    std::string which;
    int count = 0;
    for (size_t r = 0; r < all.size(); ++r) {
      const std::string what = all[r].c_str();
      if (what.empty()) continue;
      if (++count <= 8) which += std::string(which.empty() ? "" : "; ") + "rank " + std::to_string(r) + " " + what;
    }
    if (count > 8) which += "; and " + std::to_string(count - 8) + " more ranks";
    if (count > 0)
      outcome = "the checkpoint folder " + folder_ + " is not shared by every rank: " + which + " (" + name +
                ", which rank 0 wrote there). Checkpoints are written by every rank into one folder, which must be "
                "on a file system that every rank shares (a network or parallel file system such as NFS or Lustre, "
                "not a node-local disk): set job.dump_folder to such a folder, or turn checkpoint.enable off";
    std::error_code ec;
    fs::remove(fs::path(folder_) / name, ec);
  }
  outcome = coord_->broadcast(outcome);
  if (!outcome.empty()) throw UserError(outcome);
}

void Checkpointer::write_step(int64_t step, const Snapshot& snap) {
  const std::string dir = step_dir(step);
  try {
    SavingStep saving(step);
    write(dir, snap, *coord_, [&] { keep_export(step, snap); });
    finish_save(step);
  } catch (const std::exception& e) {
    throw UserError("the checkpoint save of step " + std::to_string(step) + " to " + dir + " failed: " + e.what());
  }
}

void Checkpointer::save(int64_t step, Snapshot snap) {
  wait();  // the previous save completes first (and its failure stops the run)
  if (cfg_.async_mode == "disabled") {
    write_step(step, snap);
  } else {
    // The snapshot is owned by the worker; async_with_pinned_mem gets its buffers back afterwards.
    worker_ = std::thread([this, step, snap = std::move(snap)]() mutable {
      try {
        write_step(step, snap);
      } catch (const std::exception& e) {
        // Said at once (the run stops at its next step, with this error): the main thread may be
        // blocked in a training collective with the rank that failed.
        log_(std::string("Checkpoint: error: ") + e.what());
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

void Checkpointer::keep_export(int64_t step, const Snapshot& snap) {
  const auto& contents = snap.info.contains("contents") ? snap.info.at("contents") : nlohmann::json::array();
  if (std::find(contents.begin(), contents.end(), "train_state") == contents.end()) return;  // an export itself
  const fs::path dir = step_dir(step);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  std::string what;
  if (fs::exists(dir / "config.json", ec) && !fs::exists(dir / kIndexFile, ec)) {
    what = "a Hugging Face export";
  } else {
    try {
      Reader r(dir.string());
      const auto& have = r.info().at("contents");
      if (std::find(have.begin(), have.end(), "train_state") != have.end()) return;  // replaced, as documented
      what = "a model-only export";
    } catch (const std::exception&) {
      return;  // not a checkpoint this save could lose anything of
    }
  }
  fs::path aside = dir.string() + ".export";
  for (int i = 2; fs::exists(aside, ec); ++i) aside = dir.string() + ".export." + std::to_string(i);
  fs::rename(dir, aside, ec);
  TITAN_USER_CHECK(!ec, "cannot move ", dir.string(), " (", what, ") aside to ", aside.string(), ": ", ec.message());
  log_("Checkpoint: " + dir.string() + " held " + what + " of an earlier run; moved it to " + aside.string() +
       " so that this save of the full training state does not replace it");
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
  if (deleter_.joinable()) deleter_.join();
  std::vector<std::string> doomed;
  for (int64_t i = 0; i + keep_older < static_cast<int64_t>(older.size()); ++i) {
    // Renamed first (atomic): a deletion cut short leaves step-N.deleting, removed by the next run.
    std::error_code ec, ignored;
    fs::rename(older[i], older[i] + ".deleting", ec);
    if (ec) fs::remove(fs::path(older[i]) / kIndexFile, ignored);  // at least no longer a checkpoint
    doomed.push_back(ec ? older[i] : older[i] + ".deleting");
  }
  // The files themselves (two per rank) in the background: the other ranks are already in the next
  // step's collectives, which must not wait for a file system's thousands of deletions.
  if (!doomed.empty())
    deleter_ = std::thread([doomed = std::move(doomed)] {
      for (const auto& dir : doomed) {
        std::error_code ec;
        fs::remove_all(dir, ec);
      }
    });
}

void Checkpointer::wait() {
  if (worker_.joinable()) worker_.join();
  if (deleter_.joinable()) deleter_.join();
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
  // Step folders that are not complete titan checkpoints are skipped, and said so.
  std::error_code ec;
  static const std::regex step_re(R"(^step-(\d+)$)");
  if (fs::is_directory(folder_, ec))
    for (const auto& e : fs::directory_iterator(folder_, ec)) {
      const std::string name = e.path().filename().string();
      if (!e.is_directory(ec) || !std::regex_match(name, step_re) || fs::exists(e.path() / kIndexFile, ec)) continue;
      log_("Checkpoint: skipping " + e.path().string() +
           (fs::exists(e.path() / "config.json", ec) ? ": a Hugging Face export, not a titan checkpoint to resume from"
                                                     : ": no " + std::string(kIndexFile) +
                                                           ", so not a complete titan checkpoint"));
    }
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
