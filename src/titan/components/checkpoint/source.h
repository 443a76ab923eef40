// A readable set of global tensors by name: a titan checkpoint folder (checkpoint.h) or a Hugging
// Face model folder (hf.h). Loading reads through this interface only, so every source can be
// loaded under any parallel layout: each rank asks for the block of each tensor it holds.
//
// Names are the checkpoint's: "model.<parameter name>" (titan's parameter names, e.g.
// "model.layers.0.attention.wq.weight"), "optimizer.<parameter name>.exp_avg", ... (docs/checkpoint.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace titan::checkpoint {

struct TensorMeta {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;  // global shape
};

// The block of `t` starting at `begin` with `length` entries per dimension (a view).
inline at::Tensor block_of(at::Tensor t, const std::vector<int64_t>& begin, const std::vector<int64_t>& length) {
  for (size_t d = 0; d < begin.size(); ++d) t = t.narrow(static_cast<int64_t>(d), begin[d], length[d]);
  return t;
}

class Source {
 public:
  virtual ~Source() = default;
  // Every tensor name the source holds, sorted.
  virtual std::vector<std::string> names() const = 0;
  // The tensor's dtype and global shape, or nullopt when the source does not hold it.
  virtual std::optional<TensorMeta> meta(const std::string& name) const = 0;
  // The block of global tensor `name` starting at `begin` with `length` entries per dimension
  // (a CPU tensor of the stored dtype), read from storage and verified. Throws titan::UserError
  // naming the file and the tensor when the data is missing, truncated or corrupt.
  virtual at::Tensor read(const std::string& name, const std::vector<int64_t>& begin,
                          const std::vector<int64_t>& length) = 0;
  // Where it is, for messages: "checkpoint outputs/checkpoint/step-10".
  virtual std::string describe() const = 0;
};

}  // namespace titan::checkpoint
