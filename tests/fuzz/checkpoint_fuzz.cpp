// Fuzz target: the checkpoint reader. Input: a step folder's index.json, then (after the file separator)
// rank-00000.safetensors and rank-00001.safetensors, then (version 2) rank-00000.slices.json and
// rank-00001.slices.json, the data files' slice indexes. Opens the folder, asks for every tensor's dtype and
// shape, reads each tensor whole and one block of it (only tensors of up to 2^20 entries: a model asks
// only for the shapes it has, checked against the index first), verifies the files' CRC-32s, and loads
// each safetensors file on its own (the Hugging Face path).
#include "fuzz_util.h"
#include "source_fuzz.h"

#include "titan/components/checkpoint/checkpoint.h"
#include "titan/components/checkpoint/safetensors.h"

#include <ATen/ATen.h>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  fuzz::torch_single_threaded();
  const auto parts = fuzz::split_files(data, size, 5);
  const std::string dir = fuzz::fresh_dir() + "/step-1";
  fuzz::fs::create_directories(dir);
  fuzz::write_file(dir + "/index.json", parts[0]);
  std::vector<std::string> files;
  for (size_t i = 1; i < parts.size() && i < 3; ++i) {
    files.push_back(dir + "/rank-0000" + std::to_string(i - 1) + ".safetensors");
    fuzz::write_file(files.back(), parts[i]);
  }
  for (size_t i = 3; i < parts.size(); ++i)
    fuzz::write_file(dir + "/rank-0000" + std::to_string(i - 3) + ".slices.json", parts[i]);
  fuzz::run_one("checkpoint", [&] {
    checkpoint::Reader reader(dir);
    // Each part on its own, so that a damaged state does not hide the tensors from the fuzzer.
    fuzz::part("checkpoint", [&] {
      (void)reader.info();
      (void)reader.state();
    });
    fuzz::part("checkpoint", [&] { fuzz::read_every_tensor(reader); });
    reader.verify_all();
  });
  for (const std::string& f : files) {
    fuzz::run_one("checkpoint/safetensors", [&] { (void)safetensors::load(f); });
  }
  return 0;
}
