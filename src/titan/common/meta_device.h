// What a meta tensor stands for. titan estimate's dry run (tools/dry_run.h) runs one rank's training
// steps on meta tensors standing for that rank's compute device: a CUDA device (the default) or the
// CPU (`titan estimate --device cpu`). The layers whose CUDA path allocates or saves otherwise than
// their CPU path at the scale of a step's peak (the loss's fused kernels, the MoE combine's, float8
// casts in cuBLAS's layouts, CUDA's autocast dtype) take, for a meta tensor, the path of the device
// it stands for, so that the dry run allocates what that device's run does (tools/dry_run.h).
#pragma once

#include <ATen/core/Tensor.h>

namespace titan {

// Whether a meta tensor stands for a CUDA tensor now (true unless a MetaStandsForCpu scope is open).
bool meta_is_cuda();

// Whether `t` is a CUDA tensor or a meta tensor standing for one.
inline bool cuda_or_standing_for_it(const at::Tensor& t) { return t.is_cuda() || (t.is_meta() && meta_is_cuda()); }

// Within its scope (process-wide: one dry run at a time), meta tensors stand for CPU tensors.
class MetaStandsForCpu {
 public:
  explicit MetaStandsForCpu(bool enable = true);
  ~MetaStandsForCpu();
  MetaStandsForCpu(const MetaStandsForCpu&) = delete;
  MetaStandsForCpu& operator=(const MetaStandsForCpu&) = delete;

 private:
  bool enabled_, previous_ = false;
};

}  // namespace titan
