// The check both checkpoint fuzz targets run on what they open (a titan checkpoint, a DCP folder):
// every tensor the source lists is known to meta(), and each small one (as a model asks only for the
// shapes it has) reads whole and as a block, the block equal byte for byte to the same part of the whole.
#pragma once

#include "fuzz_util.h"

#include "titan/components/checkpoint/source.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

namespace titan::fuzz {

// LibTorch on one thread: the first call sets it, every input runs alike.
inline void torch_single_threaded() {
  static const bool once = [] {
    at::set_num_threads(1);
    return true;
  }();
  (void)once;
}

inline bool small_shape(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || d > (1 << 20)) return false;
    n *= d;
    if (n > (1 << 20)) return false;
  }
  return shape.size() <= 8;
}

inline void read_every_tensor(checkpoint::Source& source) {
  for (const std::string& name : source.names()) {
    const auto meta = source.meta(name);
    TITAN_FUZZ_CHECK(meta, "names() lists '", name, "' but meta() does not know it");
    if (!small_shape(meta->shape)) continue;
    const std::vector<int64_t> zeros(meta->shape.size(), 0);
    const at::Tensor whole = source.read(name, zeros, meta->shape);
    TITAN_FUZZ_CHECK(whole.sizes().vec() == meta->shape && whole.scalar_type() == meta->dtype);
    std::vector<int64_t> begin(meta->shape.size()), length(meta->shape.size());
    for (size_t d = 0; d < begin.size(); ++d) {
      begin[d] = meta->shape[d] / 2;
      length[d] = meta->shape[d] - begin[d];
    }
    const at::Tensor block = source.read(name, begin, length).contiguous();
    const at::Tensor same = checkpoint::block_of(whole, begin, length).contiguous();
    // Bytes, not values: NaNs compare unequal, and not every dtype has at::equal.
    TITAN_FUZZ_CHECK(block.sizes() == same.sizes() &&
                         std::memcmp(block.data_ptr(), same.data_ptr(), block.numel() * block.element_size()) == 0,
                     "a block of '", name, "' differs from the same part of the whole tensor");
  }
}

}  // namespace titan::fuzz
