// Fuzz target: the SentencePiece model loader (a protobuf file, parsed by libsentencepiece), and
// load_tokenizer's dispatch by content, which reaches all three loaders. A tokenizer that loads is used.
#include "tokenizer_fuzz.h"

#include "titan/components/tokenizer/backends.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  const std::string path = fuzz::fresh_dir() + "/tokenizer.model";
  fuzz::write_file(path, std::string_view(reinterpret_cast<const char*>(data), size));
  return fuzz::run_one("tokenizer_sentencepiece", [&] {
    try {
      auto tok = tokenizer::load_sentencepiece_tokenizer(path);
      fuzz::exercise_tokenizer(*tok);
    } catch (const UserError&) {
    }
    auto tok = load_tokenizer(path);
    fuzz::exercise_tokenizer(*tok);
  });
}
