#include "titan/common/tensor_storage.h"

#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>

namespace titan {
namespace {
thread_local bool defer_allocation = false;
}

void allocate_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == nbytes) return;
  s->set_data_ptr_noswap(s->allocator()->allocate(nbytes));
  s->set_nbytes(nbytes);
}

void free_storage(const at::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
}

bool has_storage(const at::Tensor& t) {
  return !t.is_meta() && t.storage().nbytes() >= static_cast<size_t>(t.numel()) * t.element_size();
}

DeferAllocation::DeferAllocation() : previous_(defer_allocation) { defer_allocation = true; }
DeferAllocation::~DeferAllocation() { defer_allocation = previous_; }
bool DeferAllocation::active() { return defer_allocation; }

at::Tensor new_parameter(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  at::Tensor t = at::empty(sizes, opts);
  if (defer_allocation && !t.is_meta()) free_storage(t);
  return t;
}

}  // namespace titan
