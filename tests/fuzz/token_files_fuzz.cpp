// Fuzz target: the readers of other frameworks' pre-tokenized files (token_files.h). Input: one byte
// choosing the format and vocabulary (bit 0: Megatron-LM or llm.c; bit 1: a vocabulary of 2048 or
// 128256 tokens, so that both token widths of each format are accepted), then the files: Megatron's
// PREFIX.idx and (after the file separator) PREFIX.bin, or one llm.c .bin. Windows are read at the
// start, across the end of the epoch and after restoring a saved position; every token must be inside
// the vocabulary and a restored position must read the same window.
#include "fuzz_util.h"

#include "titan/components/data/token_files.h"

#include <algorithm>
#include <memory>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace titan;
  if (size < 1) return 0;
  const bool megatron = (data[0] & 1) == 0;
  const int64_t vocab = (data[0] & 2) ? 128256 : 2048;
  const auto parts = fuzz::split_files(data + 1, size - 1, megatron ? 2 : 1);
  const std::string dir = fuzz::fresh_dir();
  const std::string path = dir + (megatron ? "/corpus_text_document" : "/train_000000.bin");
  if (megatron) {
    fuzz::write_file(path + ".idx", parts[0]);
    if (parts.size() > 1) fuzz::write_file(path + ".bin", parts[1]);
  } else {
    fuzz::write_file(path, parts[0]);
  }
  return fuzz::run_one("token_files", [&] {
    const int64_t seq_len = 7;
    auto open = [&]() -> std::unique_ptr<data::MappedTokenSource> {
      if (megatron) return std::make_unique<data::MegatronWindowSource>(path, vocab, seq_len);
      return std::make_unique<data::LlmcWindowSource>(path, vocab, seq_len);
    };
    std::unique_ptr<data::MappedTokenSource> source = open();
    TITAN_FUZZ_CHECK(source->num_tokens() > 0, "a source of no tokens was accepted");
    std::vector<int32_t> window(static_cast<size_t>(source->window_len()));
    auto read = [&](data::MappedTokenSource& src, std::vector<int32_t>& out) {
      src.read(out.data());
      for (int32_t id : out) TITAN_FUZZ_CHECK(id >= 0 && id < vocab, "read token id ", id);
    };
    // Enough windows to wrap around a small stream, capped for large ones.
    const int64_t n = std::min<int64_t>(source->num_tokens() / source->window_len() + 2, 64);
    for (int64_t i = 0; i < n; ++i) read(*source, window);
    if (const int64_t to_end = source->num_tokens() / source->window_len() - n; to_end > 0) source->skip(to_end);
    read(*source, window);
    read(*source, window);
    const nlohmann::json state = source->state();
    std::vector<int32_t> next(window.size());
    read(*source, next);
    std::unique_ptr<data::MappedTokenSource> again = open();
    again->load_state(state);
    read(*again, window);
    TITAN_FUZZ_CHECK(window == next, "a restored position reads another window");
  });
}
