// Tokenizer interface: text <-> token ids. Implementations: Hugging Face tokenizer.json (byte-level
// BPE), tiktoken model files (Llama 3), SentencePiece models. load_tokenizer picks one from a path.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace titan {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Token ids of `text`. Special tokens written in the text (e.g. "<|begin_of_text|>") are
  // recognized as such. add_bos / add_eos prepend / append the BOS / EOS ids when the tokenizer has them.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_bos = false, bool add_eos = false) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  // Number of ids (regular + special/added), i.e. max id + 1.
  virtual int64_t vocab_size() const = 0;
  virtual std::optional<int32_t> bos_id() const = 0;
  virtual std::optional<int32_t> eos_id() const = 0;
};

// Loads the tokenizer at `path`: a tokenizer.json file, a tiktoken or SentencePiece model file, or a
// folder holding one of them (Hugging Face asset folders: tokenizer.json preferred, then
// tokenizer.model / original/tokenizer.model). A relative path missing from the current folder is
// also looked up beside the titan binary (find_asset). Throws titan::UserError saying what was expected
// when nothing usable is there.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);

}  // namespace titan
