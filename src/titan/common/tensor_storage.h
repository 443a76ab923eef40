// Tensors whose bytes come and go while the tensor object (and every view of it) stays: FSDP's
// gathered parameters, and parameters created before their values are needed.
#pragma once

#include <ATen/core/Tensor.h>

namespace titan {

// Gives `t` (contiguous, offset 0) fresh, uninitialized storage for all its elements, unless it has it.
void allocate_storage(const at::Tensor& t);
// Releases `t`'s bytes; its shape, dtype and device stay.
void free_storage(const at::Tensor& t);
// Whether `t` holds values: not meta, and its storage is allocated.
bool has_storage(const at::Tensor& t);

// While a DeferAllocation is alive (on this thread), model parameters are created without storage
// (new_parameter frees each one right after creating it), so building a model costs no memory
// beyond one tensor at a time; whoever materializes them calls allocate_storage and initializes.
class DeferAllocation {
 public:
  DeferAllocation();
  ~DeferAllocation();
  DeferAllocation(const DeferAllocation&) = delete;
  DeferAllocation& operator=(const DeferAllocation&) = delete;
  static bool active();

 private:
  bool previous_;
};

// A new parameter tensor of `sizes` (uninitialized; without storage under DeferAllocation).
at::Tensor new_parameter(at::IntArrayRef sizes, const at::TensorOptions& opts);

}  // namespace titan
