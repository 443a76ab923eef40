// The mesh: the one place that owns every process group of a run, and the one collective wrapper
// through which all communication goes (so tests can count what each mesh dimension moves).
//
// Bytes are counted per group name and operation, by the size of the full buffer an operation works
// on: all_gather counts its output (the gathered tensor), reduce_scatter its input, all_reduce and
// broadcast the tensor, send/recv the message. Calls are counted per group name and operation too.
// A group of size 1 communicates nothing and counts nothing.
#pragma once

#include "titan/distributed/parallel_dims.h"
#include "titan/common/error.h"
#include "titan/distributed/process_group.h"

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace titan::dist {

// bytes[group][op] (or calls[group][op])
using CommBytes = std::map<std::string, std::map<std::string, int64_t>>;

class Group;

// A collective that failed: timed out (a rank stopped answering) or broken (a rank died). The message
// names the mesh dimension, the operation and its number on that dimension, the error of the
// backend, and what every other member of the group was doing: each member whose collective failed
// too reports it through the store within a few seconds; the members that report nothing are the
// ranks that did not arrive (stopped, killed, or busy outside any collective).
struct CollectiveError : UserError {
  using UserError::UserError;
};

// A handle on an asynchronous collective. wait() blocks until it is done (and, on CUDA, makes the
// current stream wait); a failure throws CollectiveError. A default handle is already complete.
class Work {
 public:
  Work() = default;
  Work(c10::intrusive_ptr<c10d::Work> w, Group* group, const char* op, int64_t seq, int peer = -1)
      : work_(std::move(w)), group_(group), op_(op), seq_(seq), peer_(peer) {}
  void wait();
  // Whether it has finished (without waiting); a failure shows when wait() is called.
  bool completed() const { return !work_ || work_->isCompleted(); }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  Group* group_ = nullptr;
  const char* op_ = "";
  int64_t seq_ = 0;
  int peer_ = -1;  // point-to-point: the other member (index in the group)
};

class Group {
 public:
  // store: where members report a failed collective to each other (null: the report names no ranks).
  Group(std::string name, std::vector<int> ranks, int rank, c10::intrusive_ptr<c10d::Backend> backend,
        CommBytes* bytes, CommBytes* calls, c10::intrusive_ptr<c10d::Store> store = {},
        std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  const std::string& name() const { return name_; }
  int size() const { return static_cast<int>(ranks_.size()); }
  int rank() const { return rank_; }                        // index of this process in the group
  const std::vector<int>& ranks() const { return ranks_; }  // global ranks, in group order

  // out (size * in.numel(), contiguous) = concatenation of every member's `in`, in group order.
  Work all_gather(at::Tensor& out, const at::Tensor& in);
  // out (in.numel() / size) = this member's chunk of the element-wise sum of every member's `in`.
  Work reduce_scatter(at::Tensor& out, const at::Tensor& in);
  Work all_reduce(at::Tensor& t, c10d::ReduceOp op = c10d::ReduceOp::SUM);
  Work broadcast(at::Tensor& t, int root);  // root: index in the group
  // Member `root` receives every member's `in` (the same size on every member) into `out` (contiguous,
  // size x in.numel(), in group order); `out` is ignored on the other members.
  Work gather(at::Tensor& out, const at::Tensor& in, int root);
  // Point-to-point: `t` (contiguous) to or from member `peer` (index in the group). On Gloo a send
  // and a receive match when their tags are equal (messages between two members with one tag arrive
  // in order). NCCL ignores tags: between two members, the k-th send matches the k-th receive, and
  // the sends and receives of a pair run in posting order on one stream. With
  // TITAN_P2P_ORDER_MATCHED=1 Gloo uses one tag for every message, so it matches by order exactly as
  // NCCL does (CPU tests of code that must run on NCCL). Counted as "send" / "recv" bytes.
  Work send(const at::Tensor& t, int peer, int tag);
  // Every member sends `in` to member (rank + offset) mod size and receives `out` (as many
  // elements, contiguous) from member (rank - offset) mod size, as one collective: an all-to-all
  // whose only non-empty parts are those two (a ring step that cannot deadlock on NCCL, where
  // separate sends and receives match by order). Counted as "all_to_all" bytes (the message).
  Work shift(at::Tensor& out, const at::Tensor& in, int offset);
  Work recv(at::Tensor& t, int peer, int tag);
  // Every member sends rows [sum(in_splits[:m]), +in_splits[m]) of `in` (dim 0) to member m and
  // receives out_splits[m] rows from it into `out` (contiguous, rows in member order). The splits
  // are row counts that every pair agrees on. Counted as "all_to_all" bytes: the rows sent to the
  // other members (what crosses between ranks; a member's rows to itself are copied).
  Work all_to_all(at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                  const std::vector<int64_t>& in_splits);
  // Whether point-to-point messages match by order (NCCL, or Gloo under TITAN_P2P_ORDER_MATCHED=1).
  bool order_matched() const { return order_matched_; }
  bool nccl() const { return nccl_; }
  void barrier();
  // How long a collective of this group may wait for the others before it fails; `label` names the
  // setting in errors (e.g. "comm.train_timeout_seconds").
  void set_timeout(std::chrono::milliseconds timeout, const std::string& label = "");
  // Throws the CollectiveError of collective `op` number `seq` of this group, which failed with
  // `backend_error` (after gathering the other members' reports; see CollectiveError).
  [[noreturn]] void fail(const char* op, int64_t seq, const std::string& backend_error);
  // The same for a send or receive with member `peer` (no report of the other members: only the peer
  // takes part).
  [[noreturn]] void fail_p2p(const char* op, int peer, const std::string& backend_error);
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  void count(const char* op, const at::Tensor& t);
  Work issue(c10::intrusive_ptr<c10d::Work> w, const char* op) { return Work(std::move(w), this, op, ++seq_); }
  std::string name_;
  std::vector<int> ranks_;
  int rank_;
  c10::intrusive_ptr<c10d::Backend> backend_;  // null for a group of one
  CommBytes* bytes_;
  CommBytes* calls_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  std::string timeout_label_ = "comm.init_timeout_seconds";
  int64_t seq_ = 0;  // collectives issued on this group
  bool order_matched_ = false;
  bool nccl_ = false;
};

class Mesh {
 public:
  // Creates this rank's group along every dimension of `dims` (basic and flattened) that has more
  // than one rank, rendezvousing through `store`. Every rank must construct its Mesh at the same point.
  // gloo_host: the address Gloo binds to (see make_backend).
  Mesh(const ParallelDims& dims, int rank, const c10::intrusive_ptr<c10d::Store>& store, BackendKind backend,
       std::chrono::milliseconds timeout, const std::string& gloo_host = "127.0.0.1");
  // Destroyed while an exception unwinds (a failed run), the groups are left to the process's end:
  // destroying one joins its backend's worker threads, which may sit in a collective with a stopped
  // or dead peer until the group's timeout.
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  const ParallelDims& dims() const { return dims_; }
  int rank() const { return rank_; }
  // "pp", "dp_replicate", "dp_shard", "cp", "tp", "dp", "dp_shard_cp", "dp_cp", "world", "ep", "efsdp".
  Group& operator[](const std::string& name);

  const CommBytes& bytes() const { return bytes_; }
  const CommBytes& calls() const { return calls_; }
  // The collective timeout of every group (comm.train_timeout_seconds after the first step; the
  // groups are created with comm.init_timeout_seconds); `label` names the setting in errors.
  void set_timeout(std::chrono::milliseconds timeout, const std::string& label = "");
  // Clears the byte and call counts.
  void reset_bytes() {
    bytes_.clear();
    calls_.clear();
  }
  // Where collective inputs must live: the current CUDA device under NCCL, the CPU under Gloo.
  at::Device device() const;
  // A Gloo group of `members` (global ranks, sorted, this rank among them) for host-side coordination
  // beside training (checkpoint saves, also from a background thread): CPU tensors on any device type,
  // its own timeout (`label` names the setting in errors), unchanged by set_timeout, and its own byte
  // counts (host_bytes()). Created on the first call with a name, which every member makes at the same
  // point, connecting under `connect_timeout` (comm.init_timeout_seconds: ranks start apart); every
  // member passes the same members, and disjoint member sets of one name are separate groups (e.g.
  // each node's ranks).
  Group& host_group(const std::string& name, const std::vector<int>& members, std::chrono::milliseconds connect_timeout,
                    std::chrono::milliseconds timeout, const std::string& label);
  // Host groups of two levels for coordination among every rank, so that no group spans them all (a
  // Gloo group connects every pair of its members when it is created: N² store requests and N − 1
  // sockets per process for N members): this rank's block of `block` consecutive ranks (a node's
  // ranks, numbered node by node; rank 0's `block` is taken by every rank, so that nodes of other
  // sizes still agree), and, on each block's first rank, the group of every block's first rank
  // (null on the other ranks, and when one block holds every rank). Every rank calls it at the same
  // point; the groups are named name + "_node" and name + "_nodes".
  std::pair<Group*, Group*> host_groups_by_block(const std::string& name, int block,
                                                 std::chrono::milliseconds connect_timeout,
                                                 std::chrono::milliseconds timeout, const std::string& label);
  const CommBytes& host_bytes() const { return host_bytes_; }

 private:
  ParallelDims dims_;
  int rank_;
  BackendKind backend_;
  CommBytes bytes_, calls_;
  std::map<std::string, std::unique_ptr<Group>> groups_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string gloo_host_;
  CommBytes host_bytes_, host_calls_;
  std::map<std::string, std::unique_ptr<Group>> host_groups_;
};

}  // namespace titan::dist
