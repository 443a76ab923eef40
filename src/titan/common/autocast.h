// bf16 autocast on CUDA for the lifetime of a scope (the forward pass and the loss): matmuls run in
// bf16, reductions and the loss in fp32, master weights stay fp32. A disabled scope does nothing.
#pragma once

#include <ATen/autocast_mode.h>

namespace titan {

class CudaBf16Autocast {
 public:
  explicit CudaBf16Autocast(bool enable) : on_(enable) {
    if (!on_) return;
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
  }
  ~CudaBf16Autocast() {
    if (!on_) return;
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
  }
  CudaBf16Autocast(const CudaBf16Autocast&) = delete;
  CudaBf16Autocast& operator=(const CudaBf16Autocast&) = delete;

 private:
  bool on_;
};

}  // namespace titan
