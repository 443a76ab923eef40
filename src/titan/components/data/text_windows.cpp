#include "titan/components/data/text_windows.h"

#include "titan/common/error.h"
#include "titan/components/data/table_reader.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

namespace titan::data {

namespace {

// FNV-1a over each file's name (not its folder: a dataset may move) and size, in order, as hex.
std::string digest_of_files(const std::vector<std::string>& files) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const std::string& bytes) {
    for (unsigned char c : bytes) h = (h ^ c) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;  // a separator: ("ab", "c") and ("a", "bc") differ
  };
  for (const auto& f : files) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(f, ec);
    mix(std::filesystem::path(f).filename().string());
    mix(ec ? std::string("?") : std::to_string(size));
  }
  char out[17];
  std::snprintf(out, sizeof(out), "%016llx", static_cast<unsigned long long>(h));
  return out;
}

}  // namespace

TextWindowSource::TextWindowSource(std::vector<std::string> files, std::string text_field, const Tokenizer& tokenizer,
                                   int64_t seq_len, TokenizeTogether together)
    : reader_(std::move(files), std::move(text_field)),
      tokenizer_(tokenizer),
      window_len_(seq_len + 1),
      together_(std::move(together)) {
  TITAN_USER_CHECK(seq_len >= 1, "seq_len must be at least 1, got ", seq_len);
  TITAN_ASSERT(together_.size >= 1 && together_.rank >= 0 && together_.rank < together_.size &&
                   (together_.size == 1 || together_.all_gather),
               "TokenizeTogether: bad member ", together_.rank, " of ", together_.size);
  files_digest_ = digest_of_files(reader_.files());
  reader_.rewind(0);
  pass_tokens_ = 0;
  pass_lines_ = 0;
  appended_epoch_ = 0;
  while (head_ == buf_.size()) read_document();
}

void TextWindowSource::next_line(std::string& line, DocPos& pos) {
  while (!reader_.next_line(line, pos)) {
    TITAN_USER_CHECK(pass_lines_ != 0, "the dataset yields no tokens (", reader_.files().size(), " file(s) starting with '",
                     reader_.files().front(), "', field '", reader_.text_field(), "'): it has no documents");
    ++epoch_;
    reader_.rewind(epoch_);
    pass_lines_ = 0;
  }
  if (pass_lines_ >= 0) ++pass_lines_;
}

void TextWindowSource::append(const DocPos& pos, const std::vector<int32_t>& ids) {
  if (pos.epoch != appended_epoch_) {  // the previous epoch was appended whole
    TITAN_USER_CHECK(pass_tokens_ != 0, "the dataset yields no tokens (", reader_.files().size(), " file(s) starting with '",
                     reader_.files().front(), "', field '", reader_.text_field(),
                     "'): its documents are all empty and the tokenizer has no BOS/EOS");
    appended_epoch_ = pos.epoch;
    pass_tokens_ = 0;
  }
  buf_.insert(buf_.end(), ids.begin(), ids.end());
  docs_.push_back({pos, static_cast<int64_t>(ids.size())});
  if (pass_tokens_ >= 0) pass_tokens_ += static_cast<int64_t>(ids.size());
}

void TextWindowSource::read_document() {
  if (together_.size == 1) {
    DocPos pos;
    next_line(text_, pos);
    append(pos, tokenizer_.encode(reader_.text_of(text_, pos), /*add_bos=*/true, /*add_eos=*/true));
    return;
  }
  // A block: every member reads its lines; member r encodes documents r, r + size, ...
  std::vector<std::string> lines;
  std::vector<DocPos> positions;
  size_t bytes = 0;
  while (static_cast<int64_t>(lines.size()) < kDocsPerMember * together_.size && bytes < kBlockBytes) {
    lines.emplace_back();
    positions.emplace_back();
    next_line(lines.back(), positions.back());
    bytes += lines.back().size();
  }
  const int64_t n = static_cast<int64_t>(lines.size());
  // Mine: [1, count, length..., tokens...], or [0, the error's bytes...] when a document of mine
  // cannot be read, so that every member stops with it rather than wait.
  std::vector<int32_t> mine = {1, 0};
  try {
    std::vector<std::vector<int32_t>> encoded;
    for (int64_t k = together_.rank; k < n; k += together_.size)
      encoded.push_back(tokenizer_.encode(reader_.text_of(lines[k], positions[k]), /*add_bos=*/true, /*add_eos=*/true));
    mine[1] = static_cast<int32_t>(encoded.size());
    for (const auto& ids : encoded) mine.push_back(static_cast<int32_t>(ids.size()));
    for (const auto& ids : encoded) mine.insert(mine.end(), ids.begin(), ids.end());
  } catch (const std::exception& e) {  // a bad document (UserError), or anything else: said, not waited on
    const std::string what = e.what();
    mine.assign({0});
    mine.insert(mine.end(), what.begin(), what.end());
  }
  const std::vector<std::vector<int32_t>> all = together_.all_gather(mine);
  TITAN_ASSERT(static_cast<int>(all.size()) == together_.size, "TokenizeTogether: ", all.size(), " parts for ",
               together_.size, " members");
  for (const auto& part : all)
    if (!part.empty() && part[0] == 0) throw UserError(std::string(part.begin() + 1, part.end()));
  // Member m's documents in order: the next of each member in turn is the stream's next.
  std::vector<size_t> length_at(all.size(), 2), tokens_at(all.size());
  for (size_t m = 0; m < all.size(); ++m) tokens_at[m] = 2 + static_cast<size_t>(all[m].at(1));
  for (int64_t k = 0; k < n; ++k) {
    const size_t m = static_cast<size_t>(k % together_.size);
    const std::vector<int32_t>& part = all[m];
    const size_t len = static_cast<size_t>(part.at(length_at[m]++));
    TITAN_ASSERT(tokens_at[m] + len <= part.size(), "TokenizeTogether: member ", m, "'s part is short");
    append(positions[k], std::vector<int32_t>(part.begin() + static_cast<std::ptrdiff_t>(tokens_at[m]),
                                              part.begin() + static_cast<std::ptrdiff_t>(tokens_at[m] + len)));
    tokens_at[m] += len;
  }
}

void TextWindowSource::pop_consumed() {
  // Invariant afterwards: head_ < buf_.size() and docs_.front() holds buf_[head_].
  while (head_ == buf_.size()) read_document();
  while (static_cast<int64_t>(head_ - base_) >= docs_.front().num_tokens) {
    base_ += static_cast<size_t>(docs_.front().num_tokens);
    docs_.pop_front();
  }
  if (base_ >= 65536 && 2 * base_ >= buf_.size()) {  // compact: drop the tokens of popped documents
    buf_.erase(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(base_));
    head_ -= base_;
    base_ = 0;
  }
}

void TextWindowSource::advance(int32_t* out) {
  const size_t L = static_cast<size_t>(window_len_);
  while (buf_.size() - head_ < L) read_document();
  if (out) std::copy_n(buf_.begin() + static_cast<std::ptrdiff_t>(head_), L, out);
  head_ += L;
  pop_consumed();
}

void TextWindowSource::read(int32_t* out) { advance(out); }

void TextWindowSource::skip(int64_t n) {
  for (int64_t i = 0; i < n; ++i) advance(nullptr);
}

int64_t TextWindowSource::epoch() const { return docs_.front().pos.epoch; }

nlohmann::json TextWindowSource::state() const {
  const DocPos& p = docs_.front().pos;
  return {{"epoch", p.epoch},   {"file", p.file},
          {"offset", p.offset}, {"line", p.line},
          {"skip_tokens", static_cast<int64_t>(head_ - base_)},
          {"num_files", static_cast<int64_t>(reader_.files().size())},
          {"files_digest", files_digest_}, {"text_field", reader_.text_field()}};
}

void TextWindowSource::load_state(const nlohmann::json& s) {
  DocPos anchor;
  int64_t skip = 0, num_files = 0;
  try {
    anchor = DocPos{s.at("epoch").get<int64_t>(), s.at("file").get<int64_t>(), s.at("offset").get<int64_t>(),
                    s.at("line").get<int64_t>()};
    skip = s.at("skip_tokens").get<int64_t>();
    num_files = s.at("num_files").get<int64_t>();
  } catch (const nlohmann::json::exception& e) {
    TITAN_USER_CHECK(false, "bad text data loader state (", e.what(), "): ", s.dump());
  }
  TITAN_USER_CHECK(num_files == static_cast<int64_t>(reader_.files().size()), "the data loader state was saved with ",
                   num_files, " dataset files but the dataset now has ", reader_.files().size(),
                   ": resume with the same dataset, or start the data from the beginning with "
                   "--checkpoint.exclude_from_loading dataloader");
  // States saved before the digest existed have none: the count and the position check below remain.
  if (s.contains("files_digest") && s.at("files_digest").is_string())
    TITAN_USER_CHECK(s.at("files_digest").get<std::string>() == files_digest_, "the dataset's ", num_files,
                     " files are not the ones the data loader state was saved with (their names or sizes differ, e.g. "
                     "a new snapshot of the dataset): resume with the same dataset files, or start the data from the "
                     "beginning with --checkpoint.exclude_from_loading dataloader");
  // The same files read in another field are other documents at the same places (states saved
  // before the field was recorded have none).
  if (s.contains("text_field") && s.at("text_field").is_string())
    TITAN_USER_CHECK(s.at("text_field").get<std::string>() == reader_.text_field(),
                     "the data loader state was saved reading the text of the field '",
                     s.at("text_field").get<std::string>(), "', this run reads '", reader_.text_field(),
                     "': resume with that field (training.dataset_text_field, or text_field= in a dataset_mix entry), "
                     "or start the data from the beginning with --checkpoint.exclude_from_loading dataloader");
  reader_.seek(anchor);
  epoch_ = anchor.epoch;
  appended_epoch_ = anchor.epoch;
  pass_tokens_ = -1;
  pass_lines_ = -1;
  docs_.clear();
  buf_.clear();
  base_ = head_ = 0;
  read_document();
  const BufferedDoc& doc = docs_.front();
  TITAN_USER_CHECK(doc.pos == anchor && skip >= 0 && skip < doc.num_tokens, "the dataset no longer matches the data loader state (",
                   reader_.files()[anchor.file], ":", anchor.line, " at ",
                   is_table_file(reader_.files()[anchor.file]) ? "row " : "byte ", anchor.offset,
                   "): resume with the same dataset files and tokenizer, or start the data from the beginning with "
                   "--checkpoint.exclude_from_loading dataloader");
  head_ = static_cast<size_t>(skip);
  pop_consumed();
}

}  // namespace titan::data
