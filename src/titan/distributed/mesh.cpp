#include "titan/distributed/mesh.h"

#include "titan/common/error.h"
#include "titan/common/listing.h"
#include "titan/common/trace.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <exception>
#include <cstdlib>
#include <cstdio>
#include <memory>
#include <mutex>
#include <thread>

namespace titan::dist {

void Work::wait() {
  if (!work_) return;
  auto w = std::move(work_);
  TraceRange range("c10d::wait ", op_, " [", group_ ? group_->name() : std::string(), "]");
  try {
    // On NCCL a wait is a stream wait: the host goes on, and the backend's watchdog fails a
    // collective that exceeds the group's timeout. (A wait with a timeout would spin the host until
    // the work completes.) On Gloo a send or receive waits as long as the group's collectives may
    // (the backend's own default is the timeout it was created with, comm.init_timeout_seconds).
    if (peer_ >= 0 && group_ && group_->timeout().count() > 0 && !group_->nccl())
      w->wait(group_->timeout());
    else
      w->wait();
  } catch (const std::exception& e) {
    if (!group_) throw;
    if (peer_ >= 0) group_->fail_p2p(op_, peer_, e.what());
    group_->fail(op_, seq_, e.what());
  }
}

Group::Group(std::string name, std::vector<int> ranks, int rank, c10::intrusive_ptr<c10d::Backend> backend,
             CommBytes* bytes, CommBytes* calls, c10::intrusive_ptr<c10d::Store> store,
             std::chrono::milliseconds timeout)
    : name_(std::move(name)), ranks_(std::move(ranks)), rank_(rank), backend_(std::move(backend)), bytes_(bytes),
      calls_(calls), store_(std::move(store)), timeout_(timeout) {
  nccl_ = backend_ && backend_->getBackendName() == "nccl";
  const char* matched = std::getenv("TITAN_P2P_ORDER_MATCHED");
  order_matched_ = nccl_ || (matched && std::string(matched) == "1");
}

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

}  // namespace

// The dimension a report names ("... on mesh dimension 'tp'").
static std::string dimension_of(const std::string& report) {
  const size_t at = report.find(" on mesh dimension '");
  return at == std::string::npos ? "" : report.substr(at);
}

void Group::fail(const char* op, int64_t seq, const std::string& backend_error) {
  const int me = ranks_[rank_];
  const std::string what = std::string(op) + " #" + std::to_string(seq) + " on mesh dimension '" + name_ + "'";
  std::string msg = "collective " + what + " (ranks " + joined(ranks_) + ") failed on rank " + std::to_string(me) + ": " +
                    first_line(backend_error) + " [collective timeout " + std::to_string(timeout_.count() / 1000) +
                    " s, " + timeout_label_ + "]";
  if (!store_) throw CollectiveError(msg);
  // Every rank whose collective fails posts what it was waiting in (and, after its window, the
  // members that did not arrive) under its global rank; here the other members' posts are awaited
  // for a few seconds (their timeouts began when they issued, a little apart). The store is asked
  // from a thread with a deadline: if its host is the stopped rank, nothing may wait for it.
  const auto window = std::clamp<std::chrono::milliseconds>(timeout_ / 4, std::chrono::seconds(1), std::chrono::seconds(5));
  const auto deadline = std::chrono::steady_clock::now() + window;
  struct Shared {
    std::mutex mutex;
    std::map<int, std::string> reports;  // member -> its post
    bool finished = false;
  };
  auto shared = std::make_shared<Shared>();
  auto store = store_;
  const std::vector<int> members = ranks_;
  auto key = [](int r) { return "collective_failure/" + std::to_string(r); };
  std::thread([store, members, me, what, deadline, shared, key] {
    try {
      store->set(key(me), std::vector<uint8_t>(what.begin(), what.end()));
      // Until the deadline: every member's post. Then, for a moment longer, the final posts (with
      // their missing ranks) of members blocked elsewhere, which finish their own windows.
      const auto final_deadline = deadline + std::chrono::milliseconds(1500);
      while (std::chrono::steady_clock::now() < final_deadline) {
        bool all = true;
        for (int r : members) {
          if (r == me) continue;
          std::string known;
          {
            std::lock_guard<std::mutex> lock(shared->mutex);
            auto it = shared->reports.find(r);
            if (it != shared->reports.end()) known = it->second;
          }
          const bool want_final = !known.empty() && known.find('\n') == std::string::npos &&
                                  dimension_of(known) != dimension_of(what);
          if (!known.empty() && !want_final) continue;
          if (known.empty() && std::chrono::steady_clock::now() >= deadline) continue;
          all = false;
          if (store->check({key(r)})) {
            const auto v = store->get(key(r));
            std::lock_guard<std::mutex> lock(shared->mutex);
            shared->reports[r] = std::string(v.begin(), v.end());
          }
        }
        if (all) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    } catch (const std::exception&) {
    }
    std::lock_guard<std::mutex> lock(shared->mutex);
    shared->finished = true;
  }).detach();
  auto snapshot = [&] {
    std::lock_guard<std::mutex> lock(shared->mutex);
    return shared->reports;
  };
  while (std::chrono::steady_clock::now() < deadline && snapshot().size() + 1 < members.size())
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::vector<int> missing;
  {
    const auto arrived = snapshot();
    for (int r : members)
      if (r != me && !arrived.count(r)) missing.push_back(r);
  }
  // Post the missing members for the others' reports, then wait for the final posts of members
  // blocked on other dimensions (the reporting thread ends by itself).
  if (!missing.empty()) {
    const std::string final_post = what + "\n" + joined(missing);
    std::thread([store, me, final_post, key] {
      try {
        store->set(key(me), std::vector<uint8_t>(final_post.begin(), final_post.end()));
      } catch (const std::exception&) {
      }
    }).detach();
  }
  const auto final_deadline = deadline + std::chrono::milliseconds(1600);
  while (std::chrono::steady_clock::now() < final_deadline) {
    {
      std::lock_guard<std::mutex> lock(shared->mutex);
      if (shared->finished) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::vector<int> same;
  std::string details;
  bool disagree = false;
  for (const auto& [r, post] : snapshot()) {
    const size_t nl = post.find('\n');
    const std::string where = post.substr(0, nl);
    if (where == what) {
      same.push_back(r);
      continue;
    }
    if (dimension_of(where) == dimension_of(what)) {
      disagree = true;
      details += "\n  rank " + std::to_string(r) + " was waiting in " + where + " instead";
    } else {
      details += "\n  rank " + std::to_string(r) + " is blocked in " + where;
      if (nl != std::string::npos) details += ", where rank(s) " + post.substr(nl + 1) + " did not arrive";
    }
  }
  if (!same.empty()) msg += "\n  ranks waiting in the same collective: " + joined(same);
  msg += details;
  if (!missing.empty()) {
    char secs[16];
    std::snprintf(secs, sizeof secs, "%.2g", std::chrono::duration<double>(window).count());
    msg += "\n  ranks that did not arrive: " + joined(missing) + " (no report within " + secs +
           " s: stopped, killed, or busy outside any collective; see their logs)";
  }
  if (disagree) msg += "\n  ranks disagree on the order of collectives on this dimension: a rank took another code path";
  throw CollectiveError(msg);
}

// The byte and call counts of a mesh's groups share maps, and host groups run collectives from other
// threads too (the background save, the preemption vote): every update takes this lock.
static std::mutex& counts_mutex() {
  static std::mutex m;
  return m;
}

void Group::count(const char* op, const at::Tensor& t) {
  if (size() <= 1) return;
  std::lock_guard<std::mutex> lock(counts_mutex());
  (*bytes_)[name_][op] += static_cast<int64_t>(t.numel() * t.element_size());
  (*calls_)[name_][op] += 1;
}

Work Group::all_gather(at::Tensor& out, const at::Tensor& in) {
  TITAN_ASSERT(out.is_contiguous() && out.numel() == in.numel() * size(), "all_gather: output must hold size x input");
  TraceRange range(mem::Phase::Communication, "c10d::all_gather [", name_, "]");
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
  TraceRange range(mem::Phase::Communication, "c10d::reduce_scatter [", name_, "]");
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
  TraceRange range(mem::Phase::Communication, "c10d::all_reduce [", name_, "]");
  count("all_reduce", t);
  if (size() == 1) return Work();
  std::vector<at::Tensor> ts{t};
  c10d::AllreduceOptions opts;
  opts.reduceOp = op;
  return issue(backend_->allreduce(ts, opts), "all_reduce");
}

Work Group::send(const at::Tensor& t, int peer, int tag) {
  TITAN_ASSERT(t.is_contiguous() && peer >= 0 && peer < size() && peer != rank_, "send: bad tensor or peer ", peer);
  TraceRange range(mem::Phase::Communication, "c10d::send [", name_, "]");
  count("send", t);
  std::vector<at::Tensor> ts{t};
  return Work(backend_->send(ts, peer, order_matched_ ? 0 : tag), this, "send", ++seq_, peer);
}

Work Group::recv(at::Tensor& t, int peer, int tag) {
  TITAN_ASSERT(t.is_contiguous() && peer >= 0 && peer < size() && peer != rank_, "recv: bad tensor or peer ", peer);
  TraceRange range(mem::Phase::Communication, "c10d::recv [", name_, "]");
  count("recv", t);
  std::vector<at::Tensor> ts{t};
  return Work(backend_->recv(ts, peer, order_matched_ ? 0 : tag), this, "recv", ++seq_, peer);
}

Work Group::shift(at::Tensor& out, const at::Tensor& in, int offset) {
  TITAN_ASSERT(out.is_contiguous() && in.is_contiguous() && out.numel() == in.numel() && out.dtype() == in.dtype(),
               "shift: out must be contiguous and match in");
  TraceRange range(mem::Phase::Communication, "c10d::all_to_all [", name_, "]");
  const int n = size(), to = ((rank_ + offset) % n + n) % n, from = ((rank_ - offset) % n + n) % n;
  if (to == rank_) {
    out.copy_(in);
    return Work();
  }
  count("all_to_all", in);
  std::vector<int64_t> in_splits(n, 0), out_splits(n, 0);
  in_splits[to] = in.numel();
  out_splits[from] = out.numel();
  at::Tensor src = in.view({-1}), dst = out.view({-1});
  c10d::AllToAllOptions opts;
  return issue(backend_->alltoall_base(dst, src, out_splits, in_splits, opts), "all_to_all");
}

Work Group::all_to_all(at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                       const std::vector<int64_t>& in_splits) {
  const int n = size();
  TITAN_ASSERT(out.is_contiguous() && in.is_contiguous() && out.dtype() == in.dtype() &&
                   static_cast<int>(in_splits.size()) == n && static_cast<int>(out_splits.size()) == n,
               "all_to_all: contiguous tensors of one dtype and one split per member");
  TraceRange range(mem::Phase::Communication, "c10d::all_to_all [", name_, "]");
  if (n == 1) {
    out.copy_(in);
    return Work();
  }
  const int64_t row_bytes = in.dim() == 0 ? 0 : static_cast<int64_t>(in.numel() / std::max<int64_t>(in.size(0), 1) * in.element_size());
  int64_t sent_rows = 0;
  for (int m = 0; m < n; ++m)
    if (m != rank_) sent_rows += in_splits[static_cast<size_t>(m)];
  {
    std::lock_guard<std::mutex> lock(counts_mutex());
    (*bytes_)[name_]["all_to_all"] += sent_rows * row_bytes;
    (*calls_)[name_]["all_to_all"] += 1;
  }
  std::vector<int64_t> os = out_splits, is = in_splits;
  at::Tensor dst = out, src = in;
  c10d::AllToAllOptions opts;
  return issue(backend_->alltoall_base(dst, src, os, is, opts), "all_to_all");
}

void Group::fail_p2p(const char* op, int peer, const std::string& backend_error) {
  throw CollectiveError(std::string(op) + (std::string(op) == "send" ? " to" : " from") + " rank " +
                        std::to_string(ranks_[peer]) + " on mesh dimension '" + name_ + "' failed on rank " +
                        std::to_string(ranks_[rank_]) + ": " + first_line(backend_error) + " [collective timeout " +
                        std::to_string(timeout_.count() / 1000) + " s, " + timeout_label_ + "]");
}

Work Group::broadcast(at::Tensor& t, int root) {
  TraceRange range(mem::Phase::Communication, "c10d::broadcast [", name_, "]");
  count("broadcast", t);
  if (size() == 1) return Work();
  std::vector<at::Tensor> ts{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  return issue(backend_->broadcast(ts, opts), "broadcast");
}

Work Group::gather(at::Tensor& out, const at::Tensor& in, int root) {
  TITAN_ASSERT(rank_ != root || (out.is_contiguous() && out.numel() == in.numel() * size()),
               "gather: the root's output must hold size x input");
  TraceRange range(mem::Phase::Communication, "c10d::gather [", name_, "]");
  count("gather", in);
  if (size() == 1) {
    out.view(in.sizes()).copy_(in);
    return Work();
  }
  std::vector<at::Tensor> inputs{in.contiguous()};
  std::vector<std::vector<at::Tensor>> outputs;
  if (rank_ == root) outputs.push_back(out.view({size(), -1}).unbind(0));
  c10d::GatherOptions opts;
  opts.rootRank = root;
  return issue(backend_->gather(outputs, inputs, opts), "gather");
}

void Group::barrier() {
  if (size() > 1) issue(backend_->barrier(), "barrier").wait();
}

void Group::set_timeout(std::chrono::milliseconds timeout, const std::string& label) {
  if (backend_) backend_->setTimeout(timeout);
  timeout_ = timeout;
  if (!label.empty()) timeout_label_ = label;
}

void Mesh::set_timeout(std::chrono::milliseconds timeout, const std::string& label) {
  for (auto& [name, group] : groups_) group->set_timeout(timeout, label);
}

Mesh::~Mesh() {
  if (std::uncaught_exceptions() == 0) return;
  // Unwinding: a group whose peers may have failed can block in its destructor, so the groups are
  // kept, never destroyed, in a list that stays reachable (not a leak) until the process ends.
  static auto* abandoned = new std::vector<std::unique_ptr<Group>>();
  static std::mutex abandoned_mutex;
  std::lock_guard<std::mutex> lock(abandoned_mutex);
  for (auto* groups : {&groups_, &host_groups_})
    for (auto& [name, group] : *groups) abandoned->push_back(std::move(group));
}

Mesh::Mesh(const ParallelDims& dims, int rank, const c10::intrusive_ptr<c10d::Store>& store, BackendKind backend,
           std::chrono::milliseconds timeout, const std::string& gloo_host)
    : dims_(dims), rank_(rank), backend_(backend), store_(store), gloo_host_(gloo_host) {
  // "world" first: NCCL's flight recorder names its dump after the rank of the first group made.
  const std::vector<std::string> names = {"world", "pp", "dp_replicate", "dp_shard", "cp", "tp", "dp",
                                          "dp_shard_cp", "dp_cp", "ep", "efsdp"};
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
      // A name per group (the dimension's groups are disjoint: their first members differ).
      b = make_backend(backend, prefixed, dims_.rank_in(name, rank), static_cast<int>(ranks.size()), timeout, gloo_host,
                       name + "_" + std::to_string(ranks[0]), ranks);
    }
    groups_[name] = std::make_unique<Group>(name, ranks, dims_.rank_in(name, rank), b, &bytes_, &calls_, failures,
                                            timeout);
  }
}

Group& Mesh::host_group(const std::string& name, const std::vector<int>& members,
                        std::chrono::milliseconds connect_timeout, std::chrono::milliseconds timeout,
                        const std::string& label) {
  auto& g = host_groups_[name];
  if (g) return *g;
  TITAN_ASSERT(!members.empty() && std::is_sorted(members.begin(), members.end()), "host group ", name,
               ": members must be sorted global ranks");
  const auto me = std::find(members.begin(), members.end(), rank_);
  TITAN_ASSERT(me != members.end(), "host group ", name, ": rank ", rank_, " is not among its members");
  const int index = static_cast<int>(me - members.begin());
  // One store prefix per member set: the groups of one name on other nodes do not meet this one.
  const std::string prefix = name + "/" + std::to_string(members.front());
  c10::intrusive_ptr<c10d::Backend> b;
  if (members.size() > 1)
    b = make_backend(BackendKind::Gloo, c10::make_intrusive<c10d::PrefixStore>("host/" + prefix, store_), index,
                     static_cast<int>(members.size()), connect_timeout, gloo_host_);
  g = std::make_unique<Group>(name, members, index, b, &host_bytes_, &host_calls_,
                              c10::make_intrusive<c10d::PrefixStore>("titan/host/" + prefix, store_), timeout);
  g->set_timeout(timeout, label);
  return *g;
}

std::pair<Group*, Group*> Mesh::host_groups_by_block(const std::string& name, int block,
                                                     std::chrono::milliseconds connect_timeout,
                                                     std::chrono::milliseconds timeout, const std::string& label) {
  const int world = static_cast<int>(dims_.world_size());
  int agreed = block;
  if (world > 1) {  // rank 0's block size, so that every rank cuts the same blocks
    const std::string key = "titan/host_block/" + name;
    if (rank_ == 0) {
      const std::string v = std::to_string(block);
      store_->set(key, std::vector<uint8_t>(v.begin(), v.end()));
    } else {
      const auto v = store_->get(key);
      agreed = std::stoi(std::string(v.begin(), v.end()));
    }
  }
  const int b = std::clamp(agreed, 1, world);
  const int first = rank_ / b * b;
  std::vector<int> node;
  for (int r = first; r < std::min(first + b, world); ++r) node.push_back(r);
  Group& local = host_group(name + "_node", node, connect_timeout, timeout, label);
  Group* leaders = nullptr;
  if (world > b && rank_ == first) {
    std::vector<int> firsts;
    for (int r = 0; r < world; r += b) firsts.push_back(r);
    leaders = &host_group(name + "_nodes", firsts, connect_timeout, timeout, label);
  }
  return {&local, leaders};
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
