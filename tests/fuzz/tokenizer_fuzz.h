// The part the tokenizer fuzz targets share: what is done with a tokenizer that loaded.
#pragma once

#include "fuzz_util.h"

#include "titan/components/tokenizer/tokenizer.h"

namespace titan::fuzz {

// Encodes a few short texts (plain, special-token spellings, invalid UTF-8) and decodes the result and
// a few edge ids. Ids out of the vocabulary, from encode, are a bug; decode may reject ids the
// tokenizer lacks with a UserError.
inline void exercise_tokenizer(const Tokenizer& tok) {
  static const std::string_view texts[] = {
      "",
      "Hello, world! It's 2026: 12345 tokens.\n\n  indented\ttab",
      "<|begin_of_text|>text<|end_of_text|><s></s> <unk>",
      "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80",
      std::string_view("bad \xff\xfe utf-8 \xc3 \0 nul", 20),
  };
  const int64_t vocab = tok.vocab_size();
  TITAN_FUZZ_CHECK(vocab >= 0, "negative vocab_size ", vocab);
  for (auto b : {tok.bos_id(), tok.eos_id()})
    if (b) TITAN_FUZZ_CHECK(*b >= 0 && *b < vocab, "bos/eos id ", *b, " outside the vocabulary of ", vocab);
  for (std::string_view text : texts) {
    const std::vector<int32_t> ids = tok.encode(text, /*add_bos=*/true, /*add_eos=*/true);
    for (int32_t id : ids) TITAN_FUZZ_CHECK(id >= 0 && id < vocab, "encode gave id ", id, " of a vocabulary of ", vocab);
    (void)tok.decode(ids);
  }
  for (int64_t id : {int64_t{0}, vocab - 1, vocab, int64_t{-1}}) {
    try {
      (void)tok.decode({static_cast<int32_t>(id)});
    } catch (const UserError&) {
    }
  }
}

}  // namespace titan::fuzz
