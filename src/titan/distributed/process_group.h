// c10d building blocks: the TCPStore rendezvous and the communication backends (Gloo for CPU
// tensors, NCCL for CUDA tensors). The mesh (ParallelDims) builds every group through these.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <string>

namespace titan::dist {

enum class BackendKind { Gloo, NCCL };

// A TCPStore at host:port. The server (is_server) binds the port (0: any free port; read it back
// with store_port) and serves the others; clients connect, retrying until `timeout`.
c10::intrusive_ptr<c10d::Store> make_tcp_store(const std::string& host, uint16_t port, bool is_server,
                                               std::chrono::milliseconds timeout);
uint16_t store_port(const c10::intrusive_ptr<c10d::Store>& store);

// A backend over the ranks that rendezvous through `store`. Gloo binds to `gloo_host` (the
// address peers reach this rank at; "" resolves this machine's hostname, for multi-node jobs). NCCL throws a UserError when titan was built without it.
// `group_name` and `global_ranks` (the members' global ranks), when given, go to the backend's options
// (what NCCL's flight recorder records for each collective).
c10::intrusive_ptr<c10d::Backend> make_backend(BackendKind kind, const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int world_size, std::chrono::milliseconds timeout,
                                               const std::string& gloo_host = "127.0.0.1",
                                               const std::string& group_name = "",
                                               const std::vector<int>& global_ranks = {});

// Whether this binary was built with ProcessGroupNCCL (CUDA builds of libtorch).
bool nccl_compiled();

}  // namespace titan::dist
