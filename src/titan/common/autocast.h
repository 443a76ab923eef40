// bf16 autocast on a device type for the lifetime of a scope (the forward pass and the loss): matmuls
// run in bf16, reductions and the loss in fp32, master weights stay fp32. A disabled scope does nothing.
// CUDA is the training case; CPU autocast stands in for it in memory tests and benchmarks.
#pragma once

#include "titan/common/meta_device.h"

#include <ATen/autocast_mode.h>

namespace titan {

// The dtype a layer computing on `t` runs in: the autocast dtype where autocast is on for t's device,
// else t's own. A meta tensor stands for a CUDA one (titan estimate's dry run emulates CUDA's
// autocast) or the CPU (common/meta_device.h), so the dry run's layers take the dtypes that run's do.
inline at::ScalarType compute_dtype(const at::Tensor& t) {
  const at::DeviceType dev = t.is_meta() ? (meta_is_cuda() ? at::kCUDA : at::kCPU) : t.device().type();
  const bool on = at::autocast::is_autocast_available(dev) && at::autocast::is_autocast_enabled(dev);
  return on ? at::autocast::get_autocast_dtype(dev) : t.scalar_type();
}

class Bf16Autocast {
 public:
  Bf16Autocast(at::DeviceType device, bool enable) : device_(device), on_(enable) {
    if (!on_) return;
    at::autocast::set_autocast_dtype(device_, at::kBFloat16);
    at::autocast::set_autocast_enabled(device_, true);
  }
  ~Bf16Autocast() {
    if (!on_) return;
    at::autocast::set_autocast_enabled(device_, false);
    at::autocast::clear_cache();
  }
  Bf16Autocast(const Bf16Autocast&) = delete;
  Bf16Autocast& operator=(const Bf16Autocast&) = delete;

 private:
  at::DeviceType device_;
  bool on_;
};

class CudaBf16Autocast : public Bf16Autocast {
 public:
  explicit CudaBf16Autocast(bool enable) : Bf16Autocast(at::kCUDA, enable) {}
};

}  // namespace titan
