#include "titan/distributed/mesh.h"

#include "titan/common/error.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <memory>
#include <mutex>
#include <thread>

namespace titan::dist {

void Work::wait() {
  if (!work_) return;
  auto w = std::move(work_);
  try {
    w->wait();
  } catch (const std::exception& e) {
    if (!group_) throw;
    group_->fail(op_, seq_, e.what());
  }
}

Group::Group(std::string name, std::vector<int> ranks, int rank, c10::intrusive_ptr<c10d::Backend> backend,
             CommBytes* bytes, CommBytes* calls, c10::intrusive_ptr<c10d::Store> store,
             std::chrono::milliseconds timeout)
    : name_(std::move(name)), ranks_(std::move(ranks)), rank_(rank), backend_(std::move(backend)), bytes_(bytes),
      calls_(calls), store_(std::move(store)), timeout_(timeout) {}

namespace {

std::string first_line(const std::string& s) {
  const size_t nl = s.find('\n');
  std::string line = s.substr(0, nl);
  // Gloo's messages start with the source location in brackets: keep what follows.
  if (!line.empty() && line[0] == '[') {
    const size_t close = line.find("] ");
    if (close != std::string::npos) line = line.substr(close + 2);
  }
  return line;
}

std::string join(const std::vector<int>& v) {
  std::string out;
  for (int x : v) out += (out.empty() ? "" : ", ") + std::to_string(x);
  return out;
}

}  // namespace

void Group::fail(const char* op, int64_t seq, const std::string& backend_error) {
  const int me = ranks_[rank_];
  const std::string what = std::string(op) + " #" + std::to_string(seq) + " on mesh dimension '" + name_ + "'";
  std::string msg = "collective " + what + " (ranks " + join(ranks_) + ") failed on rank " + std::to_string(me) +
                    " after up to " + std::to_string(timeout_.count() / 1000) + " s (comm.train_timeout_seconds): " +
                    first_line(backend_error);
  if (!store_) throw CollectiveError(msg);
  // Every member whose collective fails posts what it was waiting in; the others are waited for a
  // few seconds (their timeouts began when they issued, a little apart). The store is asked from a
  // thread with a deadline: if its host is the stopped rank, nothing must wait for it.
  const auto window = std::clamp<std::chrono::milliseconds>(timeout_ / 4, std::chrono::seconds(1), std::chrono::seconds(5));
  const auto deadline = std::chrono::steady_clock::now() + window;
  auto reports = std::make_shared<std::map<int, std::string>>();
  auto mutex = std::make_shared<std::mutex>();
  auto store = store_;
  const std::vector<int> members = ranks_;
  std::thread([store, members, me, what, deadline, reports, mutex] {
    try {
      const std::string mine = what;
      store->set("collective_failure/" + std::to_string(me), std::vector<uint8_t>(mine.begin(), mine.end()));
      while (std::chrono::steady_clock::now() < deadline) {
        bool all = true;
        for (int r : members) {
          if (r == me) continue;
          {
            std::lock_guard<std::mutex> lock(*mutex);
            if (reports->count(r)) continue;
          }
          const std::string key = "collective_failure/" + std::to_string(r);
          if (store->check({key})) {
            const auto v = store->get(key);
            std::lock_guard<std::mutex> lock(*mutex);
            (*reports)[r] = std::string(v.begin(), v.end());
          } else {
            all = false;
          }
        }
        if (all) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    } catch (const std::exception&) {
    }
  }).detach();
  while (std::chrono::steady_clock::now() < deadline) {
    {
      std::lock_guard<std::mutex> lock(*mutex);
      if (reports->size() + 1 == members.size()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::vector<int> missing, same, elsewhere;
  std::string details;
  {
    std::lock_guard<std::mutex> lock(*mutex);
    for (int r : members) {
      if (r == me) continue;
      auto it = reports->find(r);
      if (it == reports->end()) {
        missing.push_back(r);
      } else if (it->second == what) {
        same.push_back(r);
      } else {
        elsewhere.push_back(r);
        details += "\n  rank " + std::to_string(r) + " was waiting in " + it->second + " instead";
      }
    }
  }
  if (!same.empty()) msg += "\n  ranks waiting in the same collective: " + join(same);
  msg += details;
  if (!missing.empty())
    msg += "\n  ranks that did not arrive: " + join(missing) +
           " (no report within " + std::to_string(window.count() / 1000.0).substr(0, 4) +
           " s: stopped, killed, or busy outside any collective; see their logs)";
  if (!elsewhere.empty())
    msg += "\n  ranks disagree on the order of collectives: a rank took another code path";
  throw CollectiveError(msg);
}

void Group::count(const char* op, const at::Tensor& t) {
  if (size() <= 1) return;
  (*bytes_)[name_][op] += static_cast<int64_t>(t.numel() * t.element_size());
  (*calls_)[name_][op] += 1;
}

Work Group::all_gather(at::Tensor& out, const at::Tensor& in) {
  TITAN_ASSERT(out.is_contiguous() && out.numel() == in.numel() * size(), "all_gather: output must hold size x input");
  count("all_gather", out);
  if (size() == 1) {
    out.view(in.sizes()).copy_(in);
    return Work();
  }
  // Flat views: backends expect the output to stack `size` copies of the input's shape.
  at::Tensor src = in.contiguous().view({-1}), dst = out.view({-1});
  return issue(backend_->_allgather_base(dst, src), "all_gather");
}

Work Group::reduce_scatter(at::Tensor& out, const at::Tensor& in) {
  TITAN_ASSERT(in.is_contiguous() && in.numel() == out.numel() * size(), "reduce_scatter: input must hold size x output");
  count("reduce_scatter", in);
  if (size() == 1) {
    out.copy_(in.view(out.sizes()));
    return Work();
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  at::Tensor src = in.view({-1}), dst = out.view({-1});
  return issue(backend_->_reduce_scatter_base(dst, src, opts), "reduce_scatter");
}

Work Group::all_reduce(at::Tensor& t, c10d::ReduceOp op) {
  count("all_reduce", t);
  if (size() == 1) return Work();
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  return issue(backend_->allreduce(ts, opts), "all_reduce");
}

Work Group::broadcast(at::Tensor& t, int root) {
  count("broadcast", t);
  if (size() == 1) return Work();
  std::vector<at::Tensor> ts{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  return issue(backend_->broadcast(ts, opts), "broadcast");
}

void Group::barrier() {
  if (size() > 1) issue(backend_->barrier(), "barrier").wait();
}

void Group::set_timeout(std::chrono::milliseconds timeout) {
  if (backend_) backend_->setTimeout(timeout);
  timeout_ = timeout;
}

void Mesh::set_timeout(std::chrono::milliseconds timeout) {
  for (auto& [name, group] : groups_) group->set_timeout(timeout);
}

Mesh::Mesh(const ParallelDims& dims, int rank, const c10::intrusive_ptr<c10d::Store>& store, BackendKind backend,
           std::chrono::milliseconds timeout, const std::string& gloo_host)
    : dims_(dims), rank_(rank), backend_(backend) {
  const std::vector<std::string> names = {"pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp",
                                          "dp_cp", "world"};
  // Dimensions with the same members (e.g. dp_shard, dp and world under plain FSDP) share one
  // backend; each keeps its own name for the byte counts.
  std::map<std::vector<int>, c10::intrusive_ptr<c10d::Backend>> by_members;
  auto failures = c10::make_intrusive<c10d::PrefixStore>("titan", store);
  for (const auto& name : names) {
    std::vector<int> ranks = dims_.group_ranks(name, rank);
    c10::intrusive_ptr<c10d::Backend>& b = by_members[ranks];
    if (ranks.size() > 1 && !b) {
      // Each group rendezvouses under its own prefix: its name and its first member.
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name + "/" + std::to_string(ranks[0]), store);
      b = make_backend(backend, prefixed, dims_.rank_in(name, rank), static_cast<int>(ranks.size()), timeout, gloo_host);
    }
    groups_[name] = std::make_unique<Group>(name, ranks, dims_.rank_in(name, rank), b, &bytes_, &calls_, failures,
                                            timeout);
  }
}

at::Device Mesh::device() const {
  if (backend_ != BackendKind::NCCL) return at::Device(at::kCPU);
  return at::Device(at::kCUDA, c10::impl::getDeviceGuardImpl(at::kCUDA)->getDevice().index());
}

Group& Mesh::operator[](const std::string& name) {
  auto it = groups_.find(name);
  TITAN_ASSERT(it != groups_.end(), "no mesh dimension '", name, "'");
  return *it->second;
}

}  // namespace titan::dist
