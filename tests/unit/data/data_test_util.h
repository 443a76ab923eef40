// Fixtures of the data tests: a byte-level tokenizer and writers of JSON Lines files, plain or
// compressed (gzip through zlib, zstd through libzstd).
#pragma once

#include "titan/components/data/dataloader.h"
#include "titan/components/data/document_reader.h"
#include "titan/components/tokenizer/tokenizer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <zlib.h>
#include <zstd.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace titan::test {

// One token per byte (id = byte value), BOS = 256, EOS = 257.
class ByteTokenizer : public Tokenizer {
 public:
  static constexpr int32_t kBos = 256, kEos = 257;
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool add_eos) const override {
    std::vector<int32_t> ids;
    if (add_bos && bos_id()) ids.push_back(*bos_id());
    for (unsigned char c : text) ids.push_back(c);
    if (add_eos && eos_id()) ids.push_back(*eos_id());
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string s;
    for (int32_t id : ids)
      if (id < 256) s.push_back(static_cast<char>(id));
    return s;
  }
  int64_t vocab_size() const override { return 258; }
  std::optional<int32_t> bos_id() const override { return kBos; }
  std::optional<int32_t> eos_id() const override { return kEos; }
};

// The same, without BOS/EOS ids.
class ByteTokenizerNoSpecials : public ByteTokenizer {
 public:
  int64_t vocab_size() const override { return 256; }
  std::optional<int32_t> bos_id() const override { return std::nullopt; }
  std::optional<int32_t> eos_id() const override { return std::nullopt; }
};

// `docs` as JSON Lines: {"text": doc, "id": i}.
inline std::string jsonl(const std::vector<std::string>& docs, const std::string& field = "text") {
  std::string out;
  for (size_t i = 0; i < docs.size(); ++i) out += nlohmann::json{{field, docs[i]}, {"id", i}}.dump() + "\n";
  return out;
}

inline void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// gzip, as `parts` concatenated members (a valid gzip file, as `cat a.gz b.gz` makes).
inline void write_gzip(const std::string& path, const std::vector<std::string>& parts) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).close();
  for (const auto& part : parts) {
    gzFile f = gzopen(path.c_str(), "ab");
    if (!f || gzwrite(f, part.data(), static_cast<unsigned>(part.size())) != static_cast<int>(part.size()))
      throw std::runtime_error("gzwrite failed");
    gzclose(f);
  }
}

// zstd, one frame per part.
inline std::string zstd_bytes(const std::vector<std::string>& parts) {
  std::string out;
  for (const auto& part : parts) {
    std::string frame(ZSTD_compressBound(part.size()), '\0');
    size_t n = ZSTD_compress(frame.data(), frame.size(), part.data(), part.size(), 3);
    if (ZSTD_isError(n)) throw std::runtime_error("ZSTD_compress failed");
    out += frame.substr(0, n);
  }
  return out;
}

// The reference token stream of one epoch: for each document BOS, its bytes, EOS.
inline std::vector<int32_t> byte_stream(const std::vector<std::string>& docs) {
  std::vector<int32_t> s;
  for (const auto& d : docs) {
    s.push_back(ByteTokenizer::kBos);
    for (unsigned char c : d) s.push_back(c);
    s.push_back(ByteTokenizer::kEos);
  }
  return s;
}

// The data loader options of rank `rank` of `world` reading `path` (as dataset "c4": any local path).
inline data::DataConfig config(const std::string& path, int64_t batch, int64_t seq_len, int rank = 0, int world = 1) {
  data::DataConfig c;
  c.dataset = "c4";
  c.dataset_path = path;
  c.local_batch_size = batch;
  c.seq_len = seq_len;
  c.dp_rank = rank;
  c.dp_world = world;
  return c;
}

// An llm.c token file in its GPT-2 format (token_files.h): a 256-int32 header, then n uint16 ids, the
// i-th being id(i).
inline void write_llmc_gpt2(const std::string& path, int n, const std::function<int(int)>& id) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240520;
  header[1] = 1;
  header[2] = n;
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), 1024);
  for (int i = 0; i < n; ++i) {
    const auto v = static_cast<uint16_t>(id(i));
    out.write(reinterpret_cast<const char*>(&v), 2);
  }
}

// The next n batches of a loader.
inline std::vector<data::Batch> take(data::DataLoader& loader, int n) {
  std::vector<data::Batch> out;
  for (int i = 0; i < n; ++i) out.push_back(loader.next());
  return out;
}

inline void expect_same(const std::vector<data::Batch>& a, const std::vector<data::Batch>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i].inputs, b[i].inputs)) << what << ": batch " << i;
    EXPECT_TRUE(at::equal(a[i].labels, b[i].labels)) << what << ": batch " << i;
  }
}

// Every document a reader has left (and their positions).
inline std::vector<std::string> read_all(data::DocumentReader& r, std::vector<data::DocPos>* positions = nullptr) {
  std::vector<std::string> out;
  std::string text;
  data::DocPos pos;
  while (r.next(text, pos)) {
    out.push_back(text);
    if (positions) positions->push_back(pos);
  }
  return out;
}

}  // namespace titan::test
