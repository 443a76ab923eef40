// Fuzz target: the Hugging Face tokenizer.json loader. Input: tokenizer.json, optionally followed (after
// the file separator) by the tokenizer_config.json that lies beside it. A tokenizer that loads is used.
#include "tokenizer_fuzz.h"

#include "titan/components/tokenizer/backends.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  const auto parts = fuzz::split_files(data, size, 2);
  const std::string dir = fuzz::fresh_dir();
  fuzz::write_file(dir + "/tokenizer.json", parts[0]);
  if (parts.size() > 1) fuzz::write_file(dir + "/tokenizer_config.json", parts[1]);
  return fuzz::run_one("tokenizer_hf", [&] {
    auto tok = tokenizer::load_hf_tokenizer(dir + "/tokenizer.json");
    fuzz::exercise_tokenizer(*tok);
  });
}
