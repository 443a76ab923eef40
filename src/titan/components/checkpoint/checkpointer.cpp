#include "titan/components/checkpoint/checkpointer.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/file_io.h"

#include <filesystem>
#include <regex>

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
  if (coord_->rank() != 0 || !fs::is_directory(folder_)) return;
  // Saves that were interrupted (a crash or kill during the write) left step-N.partial folders, and
  // replacements step-N.old; none of them is a checkpoint.
  static const std::regex leftover(R"(^step-\d+\.(partial|old)$)");
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(folder_, ec)) {
    const std::string name = e.path().filename().string();
    if (!std::regex_match(name, leftover)) continue;
    fs::remove_all(e.path(), ec);
    log_("Checkpoint: removed " + e.path().string() + ", left by a save that did not complete");
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

bool Checkpointer::should_save(int64_t step, int64_t last_step) const {
  if (!cfg_.enable || cfg_.load_only) return false;
  return step % cfg_.interval == 0 || step == last_step || (step == 1 && cfg_.enable_first_step_checkpoint);
}

void Checkpointer::save(int64_t step, Snapshot snap) {
  const auto t0 = std::chrono::steady_clock::now();
  wait();  // the previous save completes first (and its failure stops the run)
  const std::string dir = step_dir(step);
  if (cfg_.async_mode == "disabled") {
    write(dir, snap, *coord_);
    finish_save(step);
  } else {
    // The snapshot is owned by the worker; async_with_pinned_mem gets its buffers back afterwards.
    worker_ = std::thread([this, dir, step, snap = std::move(snap)]() mutable {
      try {
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
  last_blocking_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Checkpointer::finish_save(int64_t step) {
  if (coord_->rank() != 0) return;
  log_("Checkpoint: saved step " + std::to_string(step) + " to " + step_dir(step));
  if (cfg_.keep_latest_k <= 0) return;
  auto all = list_checkpoints(folder_);
  while (static_cast<int64_t>(all.size()) > cfg_.keep_latest_k) {
    std::error_code ec;
    fs::remove_all(all.begin()->second, ec);
    all.erase(all.begin());
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

std::optional<std::string> Checkpointer::resume_dir() const {
  auto all = list_checkpoints(folder_);
  if (cfg_.load_step >= 0) {
    auto it = all.find(cfg_.load_step);
    std::string have;
    for (const auto& [s, d] : all) have += (have.empty() ? "" : ", ") + std::to_string(s);
    TITAN_USER_CHECK(it != all.end(), "checkpoint.load_step ", cfg_.load_step, ": ", folder_,
                     " has no complete checkpoint of that step (complete ones: ", have.empty() ? "none" : have, ")");
    return it->second;
  }
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    Reader r(it->second);
    const auto& contents = r.info().at("contents");
    const bool full = std::find(contents.begin(), contents.end(), "train_state") != contents.end();
    if (full || it->first == 0) return it->second;
    log_("Checkpoint: " + it->second + " holds only the model (an export after the last step); not resuming from it");
  }
  return std::nullopt;
}

}  // namespace titan::checkpoint
