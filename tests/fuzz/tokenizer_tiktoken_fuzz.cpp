// Fuzz target: the tiktoken model loader ("<base64 token> <rank>" lines). A tokenizer that loads is used.
#include "tokenizer_fuzz.h"

#include "titan/components/tokenizer/backends.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  const std::string path = fuzz::fresh_dir() + "/tokenizer.model";
  fuzz::write_file(path, std::string_view(reinterpret_cast<const char*>(data), size));
  return fuzz::run_one("tokenizer_tiktoken", [&] {
    (void)tokenizer::looks_like_tiktoken(path);
    auto tok = tokenizer::load_tiktoken_tokenizer(path);
    fuzz::exercise_tokenizer(*tok);
  });
}
