#include "titan/models/model.h"

#include "titan/common/error.h"
#include "titan/common/tensor_storage.h"

#include <ATen/ATen.h>

namespace titan {

void LanguageModelImpl::init_weights(uint64_t seed) {
  for (const auto& p : named_parameters())
    if (has_storage(p.value())) init_region(seed, p.key(), p.value(), std::vector<int64_t>(p.value().dim(), 0));
}

std::vector<int64_t> LanguageModelImpl::global_shape(const std::string& name) const {
  auto it = global_shapes_.find(name);
  if (it != global_shapes_.end()) return it->second;
  const auto params = named_parameters();  // find() points into it: it must outlive `param`
  const at::Tensor* param = params.find(name);
  TITAN_ASSERT(param, "the model has no parameter '", name, "'");
  return param->sizes().vec();
}

void LanguageModelImpl::keep_global_shapes() {
  for (const auto& p : named_parameters()) global_shapes_.emplace(p.key(), p.value().sizes().vec());
}

void LanguageModelImpl::init_rows(uint64_t seed, const std::string& name, at::Tensor rows, int64_t first_row) const {
  std::vector<int64_t> begin(rows.dim(), 0);
  if (!begin.empty()) begin[0] = first_row;
  init_region(seed, name, std::move(rows), begin);
}

void LanguageModelImpl::init_region(uint64_t seed, const std::string& name, at::Tensor out,
                                    const std::vector<int64_t>& begin) const {
  const std::vector<int64_t> shape = global_shape(name);
  bool inside = out.dim() == static_cast<int64_t>(shape.size()) && begin.size() == shape.size();
  for (size_t d = 0; inside && d < shape.size(); ++d)
    inside = begin[d] >= 0 && begin[d] + out.size(static_cast<int64_t>(d)) <= shape[d];
  TITAN_ASSERT(inside, "init of '", name, "' ", c10::IntArrayRef(shape), ": a block ", out.sizes(), " at ",
               c10::IntArrayRef(begin), " is not inside the parameter");
  if (out.numel() == 0) return;
  // Row-major strides of the global parameter; the block is generated in runs that are contiguous
  // in the global parameter: whole trailing dimensions where the block spans them.
  std::vector<int64_t> stride(shape.size(), 1);
  for (size_t d = shape.size(); d-- > 1;) stride[d - 1] = stride[d] * shape[d];
  size_t split = shape.size();  // dimensions [split, end) are whole: one run covers them
  while (split > 0 && out.size(static_cast<int64_t>(split - 1)) == shape[split - 1]) --split;
  if (split <= 1) {  // one contiguous run (at most dim 0 is partial)
    at::Tensor flat = out.is_contiguous() ? out.view({-1}) : at::empty({out.numel()}, out.options());
    init_elements(seed, name, flat, shape.empty() ? 0 : begin[0] * stride[0]);
    if (!out.is_contiguous()) out.copy_(flat.view(out.sizes()));
    return;
  }
  // Several runs: iterate over the indices of dimensions [0, split - 1); each run spans dimension
  // split - 1's block and the whole dimensions after it.
  const int64_t outer = [&] {
    int64_t n = 1;
    for (size_t d = 0; d + 1 < split; ++d) n *= out.size(static_cast<int64_t>(d));
    return n;
  }();
  at::Tensor runs = out.reshape({outer, -1});  // a copy when out is not contiguous
  for (int64_t i = 0; i < outer; ++i) {
    int64_t first = begin[split - 1] * stride[split - 1], rest = i;
    for (size_t d = split - 1; d-- > 0;) {
      const int64_t size = out.size(static_cast<int64_t>(d));
      first += (begin[d] + rest % size) * stride[d];
      rest /= size;
    }
    init_elements(seed, name, runs[i], first);
  }
  if (!runs.is_same(out) && runs.data_ptr() != out.data_ptr()) out.copy_(runs.view(out.sizes()));
}

int64_t LanguageModelImpl::num_params() const {
  // Of the global parameters: a tensor-parallel shard counts as its whole tensor.
  int64_t n = 0;
  for (const auto& p : named_parameters()) {
    int64_t numel = 1;
    for (int64_t d : global_shape(p.key())) numel *= d;
    n += numel;
  }
  return n;
}

double moe_aux_loss_coeff(const std::optional<double>& configured, const LanguageModelImpl& model,
                          const std::string& name, const std::string& flavor) {
  const auto layers = model.moe_layers();
  if (layers.empty()) {
    TITAN_USER_CHECK(configured.value_or(0) == 0, "model.moe_aux_loss_coeff ", configured.value_or(0),
                     " balances the experts of a mixture-of-experts model, but model ", name, " ", flavor,
                     " has no MoE layers: remove the option");
    return 0;
  }
  return configured.value_or(layers.front().second->options().aux_loss_coeff);
}

}  // namespace titan
