#include "titan/distributed/process_group.h"

#include "titan/common/error.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <ifaddrs.h>
#include <netinet/in.h>

#include <cstdlib>
#include <cstring>
#include <sstream>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace titan::dist {

namespace {

// Whether the host has a network interface of this name with an IPv4 or IPv6 address, which Gloo
// needs to bind it. Asked before Gloo is (Gloo's own lookup keeps the interface list when it fails).
bool interface_has_address(const std::string& name) {
  struct ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return true;  // cannot tell: Gloo's lookup decides
  bool found = false;
  for (struct ifaddrs* a = list; a != nullptr && !found; a = a->ifa_next)
    found = a->ifa_addr != nullptr && (a->ifa_addr->sa_family == AF_INET || a->ifa_addr->sa_family == AF_INET6) &&
            std::strcmp(a->ifa_name, name.c_str()) == 0;
  freeifaddrs(list);
  return found;
}

}  // namespace

c10::intrusive_ptr<c10d::Store> make_tcp_store(const std::string& host, uint16_t port, bool is_server,
                                               std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = port;
  opts.isServer = is_server;
  opts.waitWorkers = false;  // the server does not wait for a fixed count; backends rendezvous themselves
  opts.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(host, opts);
  } catch (const c10::Error& e) {
    throw UserError("cannot " + std::string(is_server ? "start" : "reach") + " the rendezvous store at " + host +
                    ":" + std::to_string(port) + " (" + e.what_without_backtrace() +
                    "). Check MASTER_ADDR/MASTER_PORT: the address must be reachable from every node and "
                    "the port free on the master.");
  }
}

uint16_t store_port(const c10::intrusive_ptr<c10d::Store>& store) {
  auto* tcp = dynamic_cast<c10d::TCPStore*>(store.get());
  TITAN_ASSERT(tcp != nullptr, "store_port needs a TCPStore");
  return tcp->getPort();
}

c10::intrusive_ptr<c10d::Backend> make_backend(BackendKind kind, const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int world_size, std::chrono::milliseconds timeout,
                                               const std::string& gloo_host, const std::string& group_name,
                                               const std::vector<int>& global_ranks) {
  TITAN_ASSERT(rank >= 0 && rank < world_size, "rank ", rank, " outside world of size ", world_size);
  if (kind == BackendKind::Gloo) {
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    // GLOO_SOCKET_IFNAME (comma-separated interfaces), as PyTorch reads it: where the host name
    // resolves to a loopback or the wrong network, the interfaces to use instead.
    const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
    if (ifname && *ifname) {
      std::stringstream names(ifname);
      for (std::string name; std::getline(names, name, ',');) {
        if (name.empty()) continue;
        const std::string what = "GLOO_SOCKET_IFNAME names the network interface '" + name + "', which ";
        const std::string todo =
            "; list the interfaces with `ip -brief address` and name one that reaches the other nodes";
        TITAN_USER_CHECK(interface_has_address(name), what, "this host has not (or it has no IPv4/IPv6 address)",
                         todo);
        try {
          opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
        } catch (const std::exception& e) {
          throw UserError(what + "Gloo cannot use on this host (" + e.what() + ")" + todo);
        }
      }
      TITAN_USER_CHECK(!opts->devices.empty(), "GLOO_SOCKET_IFNAME '", ifname, "' names no interface");
    } else {
      opts->devices.push_back(gloo_host.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                                                : c10d::ProcessGroupGloo::createDeviceForHostname(gloo_host));
    }
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, opts);
  }
#ifdef USE_C10D_NCCL
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  opts->group_name = group_name;
  for (int r : global_ranks) opts->global_ranks_in_group.push_back(static_cast<uint64_t>(r));
  try {
    return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, opts);
  } catch (const c10::Error& e) {
    throw UserError(std::string("cannot create the NCCL backend: ") + e.what_without_backtrace() +
                    "\nNCCL needs one visible GPU per local rank; on a machine without GPUs train on CPU (Gloo).");
  }
#else
  throw UserError("this titan was built against a CPU-only libtorch, so it has no NCCL backend; "
                  "rebuild against a CUDA libtorch (see README) or train on CPU with Gloo");
#endif
}

bool nccl_compiled() {
#ifdef USE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

}  // namespace titan::dist
