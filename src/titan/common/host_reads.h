// Host reads of tensor values (an .item(), a bool of a tensor: aten::_local_scalar_dense, called
// directly or through aten::item), counted on the thread that creates the counter while it lives.
// On CUDA such a read waits for the device; a training step that makes none never stalls the host.
// Reads inside another operator's kernel are not counted: ATen's CPU fused AdamW reads each step
// count on the host (a CPU tensor, no synchronization) where its CUDA kernel reads it on the device.
// Not seen: synchronizations that are not value reads (a device-to-host copy, nonzero, an explicit
// synchronize), and reads on the autograd engine's device threads (on CPU, backward runs on the
// calling thread, so the CPU suite sees them all).
#pragma once

#include <ATen/record_function.h>

#include <cstdint>
#include <thread>

namespace titan {

class HostReadCounter {
 public:
  HostReadCounter();
  ~HostReadCounter();
  HostReadCounter(const HostReadCounter&) = delete;
  HostReadCounter& operator=(const HostReadCounter&) = delete;
  int64_t count() const;

 private:
  at::CallbackHandle handle_;
};

}  // namespace titan
