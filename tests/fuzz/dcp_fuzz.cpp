// Fuzz target: torch.distributed.checkpoint folders (torchtitan's checkpoints). Input: the `.metadata`
// pickle, then (after the file separator) `__0_0.distcp`. Parses the pickle alone (titan's reader), then
// opens the folder, asks for every tensor's dtype and shape, reads each small tensor whole and one block
// of it, the state and the optimizer's settings.
#include "fuzz_util.h"

#include "titan/components/checkpoint/dcp.h"
#include "titan/components/checkpoint/pickle.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <stdexcept>

namespace {

bool small_shape(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || d > (1 << 20)) return false;
    n *= d;
    if (n > (1 << 20)) return false;
  }
  return shape.size() <= 8;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  static const bool once = [] {
    at::set_num_threads(1);
    return true;
  }();
  (void)once;
  const auto parts = fuzz::split_files(data, size, 2);
  try {
    (void)pickle::parse(parts[0]);
  } catch (const std::runtime_error&) {
  }
  const std::string dir = fuzz::fresh_dir() + "/step-1";
  fuzz::fs::create_directories(dir);
  fuzz::write_file(dir + "/.metadata", parts[0]);
  if (parts.size() > 1) fuzz::write_file(dir + "/__0_0.distcp", parts[1]);
  fuzz::run_one("dcp", [&] {
    checkpoint::DcpSource source(dir);
    (void)source.contents();
    (void)source.state(2);
    (void)source.optimizer_hyperparameters();
    (void)source.unread_summary();
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
      TITAN_FUZZ_CHECK(block.sizes() == same.sizes() &&
                           std::memcmp(block.data_ptr(), same.data_ptr(), block.numel() * block.element_size()) == 0,
                       "a block of '", name, "' differs from the same part of the whole tensor");
    }
  });
  return 0;
}
