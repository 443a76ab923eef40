// Other frameworks' pre-tokenized files: Megatron-LM indexed datasets (.bin + .idx) and llm.c token
// files, written by transcriptions of their writers (tests/reference/token_files_reference.py), serve
// their tokens as one stream; they resume exactly, are found from a prefix, a file, a folder or a
// pattern, and refuse another tokenizer's data and damaged files with the file's name.
#include "data/data_test_util.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/data/dataloader.h"
#include "titan/components/data/token_files.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

namespace titan {
namespace {

namespace fs = std::filesystem;
const std::string kReference = std::string(TITAN_SOURCE_DIR) + "/tests/reference/token_files_reference.py";

using Docs = std::vector<std::vector<std::vector<int64_t>>>;  // documents of sequences of tokens

// Documents of 1-3 sequences of varied lengths (one empty), ids below `vocab`, each document ending
// with `eod` as Megatron's --append-eod makes it.
Docs make_docs(int n, int64_t vocab, int64_t eod, uint32_t seed) {
  std::mt19937 gen(seed);
  Docs docs;
  for (int d = 0; d < n; ++d) {
    std::vector<std::vector<int64_t>> doc;
    const int sequences = 1 + d % 3;
    for (int s = 0; s < sequences; ++s) {
      std::vector<int64_t> seq;
      const int len = (d * 7 + s * 5) % 23;
      for (int i = 0; i < len; ++i) seq.push_back(static_cast<int64_t>(gen() % static_cast<uint32_t>(vocab - 1)));
      doc.push_back(seq);
    }
    doc.back().push_back(eod);
    docs.push_back(doc);
  }
  return docs;
}

std::vector<int64_t> stream_of(const Docs& docs) {
  std::vector<int64_t> out;
  for (const auto& doc : docs)
    for (const auto& seq : doc) out.insert(out.end(), seq.begin(), seq.end());
  return out;
}

void write_megatron(const std::string& prefix, int64_t vocab, const Docs& docs) {
  auto r = test::run_process({test::python(), kReference, "megatron", prefix, std::to_string(vocab),
                              nlohmann::json(docs).dump()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
}

void write_llmc(const std::string& file, const std::string& model, const std::vector<int64_t>& tokens) {
  auto r = test::run_process({test::python(), kReference, "llmc", file, model, nlohmann::json(tokens).dump()});
  ASSERT_EQ(r.exit_code, 0) << r.output;
}

// The first n windows of `source` against the stream's windows (k*L + i) mod T.
void expect_windows(data::WindowSource& source, const std::vector<int64_t>& stream, int n, const std::string& what) {
  const int64_t L = source.window_len(), T = static_cast<int64_t>(stream.size());
  std::vector<int32_t> window(static_cast<size_t>(L));
  for (int k = 0; k < n; ++k) {
    source.read(window.data());
    for (int64_t i = 0; i < L; ++i)
      ASSERT_EQ(window[static_cast<size_t>(i)], stream[static_cast<size_t>((k * L + i) % T)])
          << what << ": window " << k << " token " << i;
  }
}

using test::config;

TEST(MegatronData, ServesTheSequencesOfEveryPrefixInOrder) {
  test::TempDir dir;
  test::ByteTokenizer tok;  // 258 tokens: Megatron writes uint16
  fs::create_directories(dir / "corpus");
  const Docs a = make_docs(17, 258, 257, 1), b = make_docs(9, 258, 257, 2);
  write_megatron(dir / "corpus/part-b_text_document", 258, b);
  write_megatron(dir / "corpus/part-a_text_document", 258, a);
  const std::vector<int64_t> sa = stream_of(a);
  std::vector<int64_t> both = sa, sb = stream_of(b);
  both.insert(both.end(), sb.begin(), sb.end());  // sorted by name: part-a, then part-b
  for (int64_t S : {5, 16, 63}) {
    const std::string s = " S=" + std::to_string(S);
    for (const std::string& path : {dir / "corpus/part-a_text_document", dir / "corpus/part-a_text_document.idx",
                                    dir / "corpus/part-a_text_document.bin"}) {
      ASSERT_EQ(data::token_file_kind(path), "megatron") << path;
      data::MegatronWindowSource src(path, tok.vocab_size(), S);
      EXPECT_EQ(src.num_tokens(), static_cast<int64_t>(sa.size()));
      EXPECT_EQ(src.num_documents(), 17);
      expect_windows(src, sa, 3 * static_cast<int>(sa.size()) / static_cast<int>(S + 1), path + s);  // 3 epochs
    }
    for (const std::string& path : {dir / "corpus", dir / "corpus/part-*_text_document.idx"}) {
      data::MegatronWindowSource src(path, tok.vocab_size(), S);
      EXPECT_EQ(src.num_files(), 2);
      expect_windows(src, both, 2 * static_cast<int>(both.size()) / static_cast<int>(S + 1), path + s);
    }
  }
  // Through the data loader, data-parallel ranks together read the single process's batches.
  auto one = data::make_dataloader(config(dir / "corpus", 4, 12), tok);
  auto r0 = data::make_dataloader(config(dir / "corpus", 2, 12, 0, 2), tok);
  auto r1 = data::make_dataloader(config(dir / "corpus", 2, 12, 1, 2), tok);
  EXPECT_NE(one->description().find("Megatron-LM indexed dataset from"), std::string::npos) << one->description();
  for (int step = 0; step < 12; ++step) {
    const data::Batch whole = one->next(), b0 = r0->next(), b1 = r1->next();
    EXPECT_TRUE(at::equal(whole.inputs, at::cat({b0.inputs, b1.inputs}))) << "step " << step;
    EXPECT_TRUE(at::equal(whole.labels, at::cat({b0.labels, b1.labels}))) << "step " << step;
  }
}

TEST(MegatronData, Int32IdsForALargeVocabularyAndAnotherTokenizersDataIsRefused) {
  test::TempDir dir;
  const Docs docs = make_docs(11, 70000, 69999, 3);  // Megatron writes int32 from 65,500 tokens
  write_megatron(dir / "big", 70000, docs);
  data::MegatronWindowSource src(dir / "big", 70000, 9);
  expect_windows(src, stream_of(docs), 20, "int32");
  // The int32 file with a small tokenizer, a uint16 file with a large one: made with another tokenizer.
  std::string e = test::error_of([&] { data::MegatronWindowSource(dir / "big", 258, 9); });
  EXPECT_NE(e.find("big.idx' stores int32 token ids, which Megatron writes for a vocabulary of at least 65,500 "
                   "tokens, but this run's tokenizer has 258"),
            std::string::npos) << e;
  write_megatron(dir / "small", 258, make_docs(5, 258, 257, 4));
  e = test::error_of([&] { data::MegatronWindowSource(dir / "small", 128256, 9); });
  EXPECT_NE(e.find("small.idx' stores uint16 token ids, which Megatron writes for a vocabulary below 65,500"),
            std::string::npos) << e;
}

TEST(MegatronData, DamagedFilesAreClearErrors) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  write_megatron(dir / "d", 258, make_docs(8, 258, 257, 5));
  const std::string bin = dir / "d.bin", idx = dir / "d.idx";
  const auto bin_size = fs::file_size(bin), idx_size = fs::file_size(idx);
  fs::resize_file(bin, bin_size - 3);
  std::string e = test::error_of([&] { data::MegatronWindowSource(dir / "d", tok.vocab_size(), 8); });
  EXPECT_NE(e.find("d.bin' is " + std::to_string(bin_size - 3) + " bytes, too short for the "), std::string::npos) << e;
  fs::resize_file(bin, bin_size);
  fs::resize_file(idx, idx_size - 9);
  e = test::error_of([&] { data::MegatronWindowSource(dir / "d", tok.vocab_size(), 8); });
  EXPECT_NE(e.find("d.idx' is " + std::to_string(idx_size - 9) + " bytes, too short for its "), std::string::npos) << e;
  test::write_file(idx, "NOTANIDX-------------------------------------");
  e = test::error_of([&] { data::MegatronWindowSource(dir / "d", tok.vocab_size(), 8); });
  EXPECT_NE(e.find("d.idx' is not a Megatron-LM index (no MMIDIDX header)"), std::string::npos) << e;
  // A token id beyond the vocabulary: refused when read, naming the file.
  write_megatron(dir / "ids", 258, {{{1, 2, 3, 300, 4}}});
  data::MegatronWindowSource src(dir / "ids", tok.vocab_size(), 4);
  std::vector<int32_t> w(5);
  e = test::error_of([&] { src.read(w.data()); });
  EXPECT_NE(e.find("ids.bin' holds token id 300, outside the tokenizer's vocabulary of 258"), std::string::npos) << e;
}

TEST(LlmcData, Gpt2AndLlama3FilesServeTheirTokensAndAPatternChoosesTheSplit) {
  test::TempDir dir;
  fs::create_directories(dir / "fineweb");
  std::mt19937 gen(7);
  auto tokens = [&](int n, uint32_t vocab) {
    std::vector<int64_t> t;
    for (int i = 0; i < n; ++i) t.push_back(gen() % vocab);
    return t;
  };
  const auto train0 = tokens(301, 50257), train1 = tokens(77, 50257), val = tokens(50, 50257);
  write_llmc(dir / "fineweb/fineweb_train_000001.bin", "gpt-2", train0);
  write_llmc(dir / "fineweb/fineweb_train_000002.bin", "gpt-2", train1);
  write_llmc(dir / "fineweb/fineweb_val_000000.bin", "gpt-2", val);
  std::vector<int64_t> train = train0;
  train.insert(train.end(), train1.begin(), train1.end());
  ASSERT_EQ(data::token_file_kind(dir / "fineweb/fineweb_train_*.bin"), "llmc");
  data::LlmcWindowSource src(dir / "fineweb/fineweb_train_*.bin", 50257, 31);
  EXPECT_EQ(src.num_files(), 2);
  expect_windows(src, train, 40, "gpt-2 train pattern");
  data::LlmcWindowSource one(dir / "fineweb/fineweb_val_000000.bin", 50257, 7);
  expect_windows(one, val, 20, "gpt-2 one file");
  // Llama 3's format: uint32 ids.
  const auto llama = tokens(200, 128256);
  write_llmc(dir / "llama.bin", "llama-3", llama);
  data::LlmcWindowSource l3(dir / "llama.bin", 128256, 15);
  expect_windows(l3, llama, 30, "llama-3");
  // GPT-2's uint16 ids cannot come from a 128,256-token tokenizer.
  std::string e = test::error_of([&] { data::LlmcWindowSource(dir / "fineweb/fineweb_val_000000.bin", 128256, 7); });
  EXPECT_NE(e.find("stores uint16 token ids (llm.c's GPT-2 format), but this run's tokenizer has 128256 tokens"),
            std::string::npos) << e;
  // A truncated file.
  fs::resize_file(dir / "llama.bin", 1024 + 4 * 199 + 2);
  e = test::error_of([&] { data::LlmcWindowSource(dir / "llama.bin", 128256, 15); });
  EXPECT_NE(e.find("llama.bin' is " + std::to_string(1024 + 4 * 199 + 2) + " bytes, too short for the 200 tokens"),
            std::string::npos) << e;
}

TEST(TokenFiles, ResumeIsExactAndAnotherDatasetIsRefused) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  write_megatron(dir / "m", 258, make_docs(20, 258, 257, 8));
  std::vector<int64_t> ids;
  for (int i = 0; i < 333; ++i) ids.push_back((i * 37) % 258);
  write_llmc(dir / "l.bin", "gpt-2", ids);
  for (const std::string& path : {dir / "m", dir / "l.bin"}) {
    for (int before : {0, 1, 7, 40}) {
      auto a = data::make_dataloader(config(path, 2, 9), tok);
      for (int i = 0; i < before; ++i) a->next();
      const std::string state = a->state();
      auto b = data::make_dataloader(config(path, 1, 9, 1, 2), tok);  // another layout resumes it too
      b->load_state(state);
      auto c = data::make_dataloader(config(path, 1, 9), tok);
      c->load_state(state);
      for (int i = 0; i < 6; ++i) {
        const data::Batch whole = a->next(), half = b->next();
        EXPECT_TRUE(at::equal(whole.inputs.slice(0, 1, 2), half.inputs)) << path << " before " << before;
        const data::Batch first = c->next();
        c->next();
        EXPECT_TRUE(at::equal(whole.inputs.slice(0, 0, 1), first.inputs)) << path << " before " << before;
      }
    }
  }
  auto m = data::make_dataloader(config(dir / "m", 2, 9), tok);
  m->next();
  const std::string e = test::error_of([&] { data::make_dataloader(config(dir / "l.bin", 2, 9), tok)->load_state(m->state()); });
  EXPECT_NE(e.find("the data loader state is for \"megatron\" data but the dataset is llmc data"), std::string::npos) << e;
  // A window count whose stream position would overflow is no saved state (reading it was undefined).
  data::LlmcWindowSource llmc(dir / "l.bin", tok.vocab_size(), 9);
  const std::string far = test::error_of(
      [&] { llmc.load_state({{"windows", int64_t{1} << 61}, {"num_tokens", llmc.num_tokens()}}); });
  EXPECT_NE(far.find("bad llmc data loader state"), std::string::npos) << far;
  llmc.load_state({{"windows", int64_t{1} << 40}, {"num_tokens", llmc.num_tokens()}});  // far, but a position
  std::vector<int32_t> window(10);
  llmc.read(window.data());
}

}  // namespace
}  // namespace titan
