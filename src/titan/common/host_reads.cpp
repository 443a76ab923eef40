#include "titan/common/host_reads.h"

#include <atomic>
#include <cstring>
#include <vector>

namespace titan {
namespace {

std::atomic<int64_t> reads{0};
std::thread::id counted_thread;

std::vector<const char*>& open_ops() {  // the operators running on this thread, outermost first
  thread_local std::vector<const char*> open;
  return open;
}

}  // namespace

HostReadCounter::HostReadCounter() {
  counted_thread = std::this_thread::get_id();
  handle_ = at::addGlobalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
            if (std::this_thread::get_id() != counted_thread) return nullptr;
            auto& open = open_ops();
            if (std::strcmp(fn.name(), "aten::_local_scalar_dense") == 0 &&
                (open.empty() || (open.size() == 1 && std::strcmp(open.back(), "aten::item") == 0)))
              ++reads;
            open.push_back(fn.name());
            return nullptr;
          },
          [](const at::RecordFunction&, at::ObserverContext*) {
            if (std::this_thread::get_id() != counted_thread) return;
            if (!open_ops().empty()) open_ops().pop_back();
          })
          .needsInputs(false)
          .scopes({at::RecordScope::FUNCTION}));
}

HostReadCounter::~HostReadCounter() { at::removeCallback(handle_); }

int64_t HostReadCounter::count() const { return reads; }

}  // namespace titan
