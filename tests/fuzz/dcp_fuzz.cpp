// Fuzz target: torch.distributed.checkpoint folders (torchtitan's checkpoints). Input: the `.metadata`
// pickle, then (after the file separator) `__0_0.distcp`. Parses the pickle alone (titan's reader), then
// opens the folder and, each on its own (a damaged value must not hide the tensors from the fuzzer),
// reads the state, the optimizer's settings, every tensor's dtype and shape, and each small tensor whole
// and one block of it.
#include "fuzz_util.h"
#include "source_fuzz.h"

#include "titan/components/checkpoint/dcp.h"
#include "titan/components/checkpoint/pickle.h"

#include <ATen/ATen.h>

#include <optional>
#include <stdexcept>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  fuzz::torch_single_threaded();
  const auto parts = fuzz::split_files(data, size, 2);
  try {
    (void)pickle::parse(parts[0]);
  } catch (const std::runtime_error&) {
  }
  const std::string dir = fuzz::fresh_dir() + "/step-1";
  fuzz::fs::create_directories(dir);
  fuzz::write_file(dir + "/.metadata", parts[0]);
  if (parts.size() > 1) fuzz::write_file(dir + "/__0_0.distcp", parts[1]);
  std::optional<checkpoint::DcpSource> source;
  fuzz::run_one("dcp", [&] { source.emplace(dir); });
  if (!source) return 0;
  // Each part on its own, so that a damaged value does not hide the tensors from the fuzzer.
  fuzz::run_one("dcp", [&] {
    (void)source->contents();
    (void)source->unread_summary();
  });
  fuzz::run_one("dcp", [&] { (void)source->state(2); });
  fuzz::run_one("dcp", [&] { (void)source->optimizer_hyperparameters(); });
  fuzz::run_one("dcp", [&] { fuzz::read_every_tensor(*source); });
  return 0;
}
