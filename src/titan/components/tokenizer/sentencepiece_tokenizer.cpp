// SentencePiece models (Llama 2 style tokenizer.model) through libsentencepiece. BOS / EOS are the
// model's bos_id / eos_id (absent when the model sets them to -1). SentencePiece itself decides which
// pieces written in the text are recognized: user-defined symbols are, control symbols such as <s> are not.
#include "titan/components/tokenizer/backends.h"

#include "titan/common/error.h"

#include <sentencepiece_processor.h>

namespace titan::tokenizer {

namespace {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    const auto status = sp_.Load(path);
    TITAN_USER_CHECK(status.ok(), path, ": not a SentencePiece model (", status.ToString(), ")");
    if (sp_.bos_id() >= 0) bos_ = sp_.bos_id();
    if (sp_.eos_id() >= 0) eos_ = sp_.eos_id();
  }

  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool add_eos) const override {
    std::vector<int> pieces;
    const auto status = sp_.Encode(text, &pieces);
    TITAN_USER_CHECK(status.ok(), path_, ": SentencePiece could not encode a text of ", text.size(),
                     " bytes: ", status.ToString());
    std::vector<int32_t> ids;
    ids.reserve(pieces.size() + 2);
    if (add_bos && bos_) ids.push_back(*bos_);
    ids.insert(ids.end(), pieces.begin(), pieces.end());
    if (add_eos && eos_) ids.push_back(*eos_);
    return ids;
  }

  std::string decode(const std::vector<int32_t>& ids) const override {
    std::vector<int> pieces(ids.begin(), ids.end());
    for (int id : pieces) {
      TITAN_USER_CHECK(id >= 0 && id < vocab_size(), "cannot decode token id ", id, ": ", path_, " has ids 0..",
                       vocab_size() - 1);
    }
    std::string text;
    const auto status = sp_.Decode(pieces, &text);
    TITAN_USER_CHECK(status.ok(), path_, ": SentencePiece could not decode: ", status.ToString());
    return text;
  }

  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::optional<int32_t> eos_id() const override { return eos_; }

 private:
  sentencepiece::SentencePieceProcessor sp_;
  std::string path_;
  std::optional<int32_t> bos_, eos_;
};

}  // namespace

std::unique_ptr<Tokenizer> load_sentencepiece_tokenizer(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

}  // namespace titan::tokenizer
