// Fuzz target: the token shard folder reader. Input: manifest.json, then (after the file separator)
// shard-00000.bin and shard-00001.bin. Opened against a fixed tokenizer description (vocabulary 2048,
// bos 0, eos 1, as the seed folders were written with), then windows are read at the start, across the
// epoch end, and after restoring a saved position; every token must be inside the vocabulary.
#include "fuzz_util.h"

#include "titan/components/data/token_shards.h"

namespace {

// Stands for the model's tokenizer: only its vocabulary size and BOS/EOS ids are compared.
class FixedTokenizer final : public titan::Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view, bool, bool) const override { return {}; }
  std::string decode(const std::vector<int32_t>&) const override { return {}; }
  int64_t vocab_size() const override { return 2048; }
  std::optional<int32_t> bos_id() const override { return 0; }
  std::optional<int32_t> eos_id() const override { return 1; }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  const auto parts = fuzz::split_files(data, size, 3);
  const std::string dir = fuzz::fresh_dir();
  fuzz::write_file(dir + "/manifest.json", parts[0]);
  for (size_t i = 1; i < parts.size(); ++i) fuzz::write_file(dir + "/shard-0000" + std::to_string(i - 1) + ".bin", parts[i]);
  return fuzz::run_one("token_shards", [&] {
    FixedTokenizer tok;
    const int64_t seq_len = 7;
    data::ShardWindowSource source(dir, tok, seq_len);
    std::vector<int32_t> window(static_cast<size_t>(source.window_len()));
    // Enough windows to wrap around a small stream, capped for large ones.
    const int64_t n = std::min<int64_t>(source.num_tokens() / source.window_len() + 2, 64);
    auto read = [&](data::ShardWindowSource& src, std::vector<int32_t>& out) {
      src.read(out.data());
      for (int32_t id : out) TITAN_FUZZ_CHECK(id >= 0 && id < tok.vocab_size(), "read token id ", id);
    };
    for (int64_t i = 0; i < n; ++i) read(source, window);
    // The last windows of the epoch and the first of the next (a long run reaches them).
    if (const int64_t to_end = source.num_tokens() / source.window_len() - n; to_end > 0) source.skip(to_end);
    read(source, window);
    read(source, window);
    const nlohmann::json state = source.state();
    std::vector<int32_t> next(window.size());
    read(source, next);
    data::ShardWindowSource again(dir, tok, seq_len);
    again.load_state(state);
    read(again, window);
    TITAN_FUZZ_CHECK(window == next, "a restored position reads another window");
  });
}
