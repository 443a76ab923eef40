#include "titan/common/meta_device.h"

#include <atomic>

namespace titan {
namespace {
std::atomic<bool> g_meta_is_cpu{false};
}  // namespace

bool meta_is_cuda() { return !g_meta_is_cpu.load(std::memory_order_relaxed); }

MetaStandsForCpu::MetaStandsForCpu(bool enable) : enabled_(enable) {
  if (enabled_) previous_ = g_meta_is_cpu.exchange(true);
}

MetaStandsForCpu::~MetaStandsForCpu() {
  if (enabled_) g_meta_is_cpu.store(previous_);
}

}  // namespace titan
