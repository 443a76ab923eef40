// Fuzz target: torch.distributed.checkpoint folders (torchtitan's checkpoints). Input: the `.metadata`
// pickle, then (after the file separator) `__0_0.distcp`. Parses the pickle alone (titan's reader), then
// opens the folder, asks for every tensor's dtype and shape, reads each small tensor whole and one block
// of it, the state and the optimizer's settings.
#include "fuzz_util.h"
#include "source_fuzz.h"

#include "titan/components/checkpoint/dcp.h"
#include "titan/components/checkpoint/pickle.h"

#include <ATen/ATen.h>

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
  fuzz::run_one("dcp", [&] {
    checkpoint::DcpSource source(dir);
    (void)source.contents();
    (void)source.state(2);
    (void)source.optimizer_hyperparameters();
    (void)source.unread_summary();
    fuzz::read_every_tensor(source);
  });
  return 0;
}
