// The data loader: windows and labels, BOS/EOS placement, the data-parallel split, epochs, exact
// resumption, token shards, and dataset names.
//
// References: the windows are checked against a Python transcription of torchtitan's
// HuggingFaceTextDataset.__iter__ buffer loop (run with the project's Python), and against the token
// stream built directly in the test (BOS + bytes + EOS per document, repeated over epochs).
#include "data/data_test_util.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/data/dataloader.h"
#include "titan/components/data/text_windows.h"
#include "titan/components/data/token_shards.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>

namespace titan {
namespace {

using test::expect_same;
using test::take;

using data::Batch;
using data::DataConfig;
using data::DataLoader;

// Documents of varied lengths, some longer than a window, one empty.
std::vector<std::string> corpus_docs() {
  std::vector<std::string> docs;
  for (int i = 0; i < 23; ++i) {
    std::string d = "doc" + std::to_string(i) + ":";
    for (int j = 0; j < (i * 7) % 31; ++j) d += static_cast<char>('a' + (i + j) % 26);
    docs.push_back(d);
  }
  docs[5] = "";
  docs[11] = std::string(90, 'L');
  return docs;
}

// The docs split over a folder: a plain file, a gzip file and a zstd file.
std::string write_corpus(const test::TempDir& dir, const std::vector<std::string>& docs) {
  std::filesystem::create_directories(dir / "text");
  std::vector<std::string> a(docs.begin(), docs.begin() + 8), b(docs.begin() + 8, docs.begin() + 15),
      c(docs.begin() + 15, docs.end());
  test::write_file(dir / "text/part0.jsonl", test::jsonl(a));
  test::write_gzip(dir / "text/part1.jsonl.gz", {test::jsonl(b)});
  test::write_file(dir / "text/part2.jsonl.zst", test::zstd_bytes({test::jsonl(c)}));
  return dir / "text";
}

using test::config;



// Sample k of the reference stream: tokens (k*L + i) mod T.
at::Tensor reference_window(const std::vector<int32_t>& stream, int64_t k, int64_t L) {
  at::Tensor w = at::empty({L}, at::kLong);
  const int64_t T = static_cast<int64_t>(stream.size());
  for (int64_t i = 0; i < L; ++i) w[i] = stream[static_cast<size_t>((k * L + i) % T)];
  return w;
}

TEST(DataLoader, WindowsFollowTorchtitansBufferLoop) {
  test::TempDir dir;
  auto docs = corpus_docs();
  test::write_file(dir / "one.jsonl", test::jsonl(docs));
  const int64_t S = 16, B = 4, steps = 20;  // 80 windows of 17 tokens: about 3 epochs of ~500 tokens
  // torchtitan's HuggingFaceTextDataset.__iter__ (infinite=True), with a byte tokenizer.
  const char* script = R"PY(
import json, sys
path, seq_len, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
docs = [json.loads(l)["text"] for l in open(path, encoding="utf-8")]
buf, out, L = [], [], seq_len + 1
while len(out) < n:
    for text in docs:
        buf.extend([256] + list(text.encode("utf-8")) + [257])
        while len(buf) >= L and len(out) < n:
            x = buf[:L]
            buf = buf[L:]
            out.append(x)
json.dump(out, open(sys.argv[4], "w"))
)PY";
  auto r = test::run_process({test::python(), "-c", script, dir / "one.jsonl", std::to_string(S),
                              std::to_string(B * steps), dir / "ref.json"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream in(dir / "ref.json");
  auto ref = nlohmann::json::parse(in);

  test::ByteTokenizer tok;
  auto loader = data::make_dataloader(config(dir / "one.jsonl", B, S), tok);
  auto stream = test::byte_stream(docs);
  for (int64_t s = 0; s < steps; ++s) {
    Batch b = loader->next();
    ASSERT_EQ(b.inputs.sizes(), (at::IntArrayRef{B, S}));
    ASSERT_EQ(b.inputs.scalar_type(), at::kLong);
    for (int64_t i = 0; i < B; ++i) {
      at::Tensor window = at::tensor(ref[s * B + i].get<std::vector<int64_t>>(), at::kLong);
      EXPECT_TRUE(at::equal(b.inputs[i], window.slice(0, 0, S))) << "step " << s << " row " << i;
      EXPECT_TRUE(at::equal(b.labels[i], window.slice(0, 1, S + 1))) << "step " << s << " row " << i;
      EXPECT_TRUE(at::equal(window, reference_window(stream, s * B + i, S + 1)));
    }
  }
  EXPECT_EQ(loader->global_samples(), B * steps);
}

// training.dataset_text_field / validation.dataset_text_field name the field holding the text.
TEST(DataLoader, TheTextFieldKeyNamesTheFieldOfEachSection) {
  test::TempDir dir;
  test::write_file(dir / "d.jsonl", "{\"content\": \"ab\", \"text\": \"xyz\"}\n");
  test::ByteTokenizer tok;
  config::Training t;
  t.dataset = "c4";
  t.dataset_path = dir / "d.jsonl";
  t.local_batch_size = 1;
  t.seq_len = 3;
  Batch b = data::make_dataloader(data::data_config(t, 0, 1), tok)->next();
  EXPECT_TRUE(at::equal(b.inputs[0], at::tensor(std::vector<int64_t>{256, 'x', 'y'}, at::kLong)));
  t.dataset_text_field = "content";
  b = data::make_dataloader(data::data_config(t, 0, 1), tok)->next();
  EXPECT_TRUE(at::equal(b.inputs[0], at::tensor(std::vector<int64_t>{256, 'a', 'b'}, at::kLong)));
  config::Validation v;
  v.dataset = "c4";
  v.dataset_path = dir / "d.jsonl";
  v.local_batch_size = 1;
  v.seq_len = 3;
  v.dataset_text_field = "body";
  const std::string msg = test::error_of([&] { data::make_dataloader(data::data_config(v, 0, 1), tok)->next(); });
  EXPECT_NE(msg.find("no text field 'body' (fields: content, text)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("training.dataset_text_field"), std::string::npos) << msg;
}

TEST(DataLoader, BosAndEosAroundEveryDocument) {
  test::TempDir dir;
  test::write_file(dir / "d.jsonl", test::jsonl({"ab", "", "cde"}));
  test::ByteTokenizer tok;
  // One window holds the whole epoch (2+2 + 0+2 + 3+2 = 11 tokens) plus the next epoch's first token.
  auto loader = data::make_dataloader(config(dir / "d.jsonl", 1, 11), tok);
  Batch b = loader->next();
  std::vector<int64_t> expect = {256, 'a', 'b', 257, 256, 257, 256, 'c', 'd', 'e', 257};
  EXPECT_TRUE(at::equal(b.inputs[0], at::tensor(expect, at::kLong)));
  expect.erase(expect.begin());
  expect.push_back(256);  // the next epoch's BOS
  EXPECT_TRUE(at::equal(b.labels[0], at::tensor(expect, at::kLong)));
}

TEST(DataLoader, RanksTogetherReadTheSingleProcessBatch) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  std::string text = write_corpus(dir, corpus_docs());
  data::tokenize_to_shards(text, tok, dir / "shards", {.tokens_per_shard = 100});
  for (const std::string& path : {text, dir / "shards"}) {
    for (int W : {2, 4}) {
      const int64_t B = 3, S = 10;
      auto single = data::make_dataloader(config(path, B * W, S), tok);
      std::vector<std::unique_ptr<DataLoader>> ranks;
      for (int r = 0; r < W; ++r) ranks.push_back(data::make_dataloader(config(path, B, S, r, W), tok));
      for (int step = 0; step < 12; ++step) {  // several epochs
        Batch g = single->next();
        std::vector<at::Tensor> in, lab;
        for (auto& r : ranks) {
          Batch b = r->next();
          ASSERT_EQ(b.inputs.size(0), B);
          in.push_back(b.inputs);
          lab.push_back(b.labels);
        }
        EXPECT_TRUE(at::equal(at::cat(in), g.inputs)) << path << " W=" << W << " step " << step;
        EXPECT_TRUE(at::equal(at::cat(lab), g.labels)) << path << " W=" << W << " step " << step;
      }
      for (auto& r : ranks) EXPECT_EQ(r->state(), single->state());  // the state is layout-free
    }
  }
}

TEST(DataLoader, EpochsLoopAndAreCounted) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  auto docs = corpus_docs();
  std::string text = write_corpus(dir, docs);
  data::tokenize_to_shards(text, tok, dir / "shards", {.tokens_per_shard = 64});
  const int64_t T = static_cast<int64_t>(test::byte_stream(docs).size());
  const int64_t S = 20, L = S + 1;
  auto from_text = data::make_dataloader(config(text, 1, S), tok);
  auto from_shards = data::make_dataloader(config(dir / "shards", 1, S), tok);
  EXPECT_EQ(from_text->epoch(), 0);
  int64_t last_epoch = 0;
  for (int64_t k = 1; k <= 4 * T / L; ++k) {
    from_text->next();
    from_shards->next();
    // The epoch of the next unread token of the stream.
    EXPECT_EQ(from_shards->epoch(), k * L / T) << k;
    EXPECT_EQ(from_text->epoch(), from_shards->epoch()) << k;
    last_epoch = from_text->epoch();
  }
  EXPECT_GE(last_epoch, 3);
}

// Reads `before` batches, saves, reads `after` more; a fresh loader restored from the state must read
// the same `after` batches.
void check_resume(const DataConfig& c, const Tokenizer& tok, int before, int after, const std::string& what) {
  auto a = data::make_dataloader(c, tok);
  take(*a, before);
  std::string state = a->state();
  auto expected = take(*a, after);
  auto b = data::make_dataloader(c, tok);
  b->load_state(state);
  EXPECT_EQ(b->global_samples(), before * c.local_batch_size * c.dp_world) << what;
  expect_same(take(*b, after), expected, what);
  EXPECT_EQ(a->state(), b->state()) << what;
}

TEST(DataLoader, ResumeIsExactForTextAndShards) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  auto docs = corpus_docs();
  std::string text = write_corpus(dir, docs);
  data::tokenize_to_shards(text, tok, dir / "shards", {.tokens_per_shard = 50});
  const int64_t T = static_cast<int64_t>(test::byte_stream(docs).size());
  for (const std::string& path : {text, dir / "shards"}) {
    for (int64_t S : {7, 13, 64}) {
      const int64_t B = 2;
      const int per_epoch = static_cast<int>(T / (B * (S + 1)));  // whole batches per epoch
      for (int before : {0, 1, 3, per_epoch, per_epoch + 1, 2 * per_epoch + 1}) {
        std::string what = path + " S=" + std::to_string(S) + " before=" + std::to_string(before);
        check_resume(config(path, B, S), tok, before, per_epoch + 3, what);  // crosses an epoch boundary
        check_resume(config(path, B, S, 1, 2), tok, before, 4, what + " rank 1 of 2");
      }
    }
  }
  // The text state is a handful of integers, not the buffered tokens.
  auto loader = data::make_dataloader(config(text, 2, 64), tok);
  take(*loader, 3);
  EXPECT_LT(loader->state().size(), 250u) << loader->state();
}

TEST(DataLoader, ResumeRejectsAnotherSeqLenOrDataset) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  std::string text = write_corpus(dir, corpus_docs());
  data::tokenize_to_shards(text, tok, dir / "shards");
  auto a = data::make_dataloader(config(text, 2, 8), tok);
  a->next();
  EXPECT_THROW(data::make_dataloader(config(text, 2, 9), tok)->load_state(a->state()), UserError);
  EXPECT_THROW(data::make_dataloader(config(dir / "shards", 2, 8), tok)->load_state(a->state()), UserError);
  EXPECT_THROW(data::make_dataloader(config(text, 2, 8), tok)->load_state("{not json"), UserError);
  // The same files in another folder resume; a later file replaced by another (same count, the position
  // itself unchanged, e.g. a new snapshot of the dataset) is refused by the files' digest.
  std::filesystem::copy(text, dir / "moved");
  auto moved = data::make_dataloader(config(dir / "moved", 2, 8), tok);
  moved->load_state(a->state());
  expect_same(take(*moved, 3), take(*a, 3), "the dataset in another folder");
  test::write_file(dir / "moved/part2.jsonl.zst", test::zstd_bytes({test::jsonl({"another", "snapshot"})}));
  const std::string err = test::error_of([&] { data::make_dataloader(config(dir / "moved", 2, 8), tok)->load_state(a->state()); });
  EXPECT_NE(err.find("are not the ones the data loader state was saved with"), std::string::npos) << err;
  test::write_file(dir / "text/part3.jsonl", test::jsonl({"more"}));
  EXPECT_THROW(data::make_dataloader(config(text, 2, 8), tok)->load_state(a->state()), UserError);
}

// With several tokenizing threads, a file with two bad lines is reported at its first one, whichever
// thread meets its bad line first: here the first bad line ends a chunk of long documents and the
// second sits in a later chunk of short ones, so the later one is met first in time.
TEST(DataShards, SeveralWorkersReportTheFirstBadLine) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  std::vector<std::string> lines;
  for (int d = 0; d < 20; ++d) lines.push_back(nlohmann::json{{"text", std::string(12000, 'a' + d % 26)}}.dump());
  lines.push_back(R"({"content": "no text field"})");  // line 21
  for (int d = 0; d < 600; ++d) lines.push_back(nlohmann::json{{"text", "short " + std::to_string(d)}}.dump());
  lines.push_back(R"({"content": "another"})");  // line 622
  for (int d = 0; d < 600; ++d) lines.push_back(nlohmann::json{{"text", "more " + std::to_string(d)}}.dump());
  std::string body;
  for (const auto& l : lines) body += l + "\n";
  test::write_file(dir / "bad.jsonl", body);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const std::string out = dir / ("shards" + std::to_string(attempt));
    const std::string err = test::error_of([&] { data::tokenize_to_shards(dir / "bad.jsonl", tok, out, {.workers = 4}); });
    EXPECT_NE(err.find("bad.jsonl:21: no text field 'text'"), std::string::npos) << "attempt " << attempt << ": " << err;
  }
}

TEST(DataShards, SameBatchesAsTextAndDocumentedFormat) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  auto docs = corpus_docs();
  std::string text = write_corpus(dir, docs);
  auto res = data::tokenize_to_shards(text, tok, dir / "shards", {.tokens_per_shard = 100, .tokenizer_name = "bytes"});
  auto stream = test::byte_stream(docs);
  EXPECT_EQ(res.num_documents, static_cast<int64_t>(docs.size()));
  EXPECT_EQ(res.num_tokens, static_cast<int64_t>(stream.size()));
  EXPECT_GT(res.num_shards, 3);

  auto t = data::make_dataloader(config(text, 3, 24), tok);
  auto s = data::make_dataloader(config(dir / "shards", 3, 24), tok);
  expect_same(take(*t, 15), take(*s, 15), "text vs shards");

  // The format as docs/data.md describes it, read independently with numpy.
  const char* script = R"PY(
import json, struct, sys, numpy as np
d = sys.argv[1]
m = json.load(open(d + "/manifest.json"))
assert m["format"] == "titan-token-shards" and m["version"] == 1, m
assert m["tokenizer"] == {"vocab_size": 258, "bos_id": 256, "eos_id": 257, "name": "bytes"}, m["tokenizer"]
toks, starts = [], []
for s in m["shards"]:
    b = open(d + "/" + s["file"], "rb").read()
    magic, ver, tb, n, nd, vocab = struct.unpack_from("<8sIIQQQ", b, 0)
    assert magic == b"TITANTOK" and ver == 1 and tb == 4 and vocab == 258 and b[40:64] == bytes(24)
    assert n == s["num_tokens"] and nd == s["num_documents"]
    t = np.frombuffer(b, dtype="<u4", count=n, offset=64)
    off = (64 + 4 * n + 7) // 8 * 8
    ds = np.frombuffer(b, dtype="<u8", count=nd, offset=off)
    assert len(b) == off + 8 * nd
    starts += [len(toks) + int(x) for x in ds]
    toks += t.tolist()
json.dump({"tokens": toks, "starts": starts}, sys.stdout)
)PY";
  auto r = test::run_process({test::python(), "-c", script, dir / "shards"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto got = nlohmann::json::parse(r.output);
  EXPECT_EQ(got["tokens"].get<std::vector<int32_t>>(), stream);
  std::vector<int64_t> starts;
  int64_t at = 0;
  for (const auto& d : docs) {
    starts.push_back(at);
    at += static_cast<int64_t>(d.size()) + 2;
  }
  EXPECT_EQ(got["starts"].get<std::vector<int64_t>>(), starts);
}

TEST(DataShards, ErrorsForAnotherTokenizerOrABadOutputFolder) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  test::ByteTokenizerNoSpecials other;
  std::string text = write_corpus(dir, corpus_docs());
  data::tokenize_to_shards(text, tok, dir / "shards");
  EXPECT_THROW(data::make_dataloader(config(dir / "shards", 1, 8), other), UserError);
  EXPECT_THROW(data::tokenize_to_shards(text, tok, dir / "shards"), UserError);  // not empty
  // A truncated shard.
  std::filesystem::resize_file(dir / "shards/shard-00000.bin", 100);
  EXPECT_THROW(data::make_dataloader(config(dir / "shards", 1, 8), tok), UserError);
}

TEST(DataLoader, DatasetNamesMapToLocalFiles) {
  test::TempDir dir;
  test::ByteTokenizer tok;
  // c4 has no default location.
  try {
    data::resolve_dataset("c4", "");
    FAIL() << "c4 without dataset_path resolved";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("training.dataset_path"), std::string::npos) << e.what();
  }
  EXPECT_THROW(data::resolve_dataset("c4", dir / "absent"), UserError);
  EXPECT_THROW(data::resolve_dataset("wikipedia", ""), UserError);
  // The bundled corpus: c4_test falls back to it when assets/c4_test is absent.
  auto corpus = data::resolve_dataset("titan_corpus", "");
  EXPECT_NE(corpus.path.find("assets/corpus/corpus.jsonl.zst"), std::string::npos) << corpus.path;
  EXPECT_EQ(corpus.kind, "text");
  auto c4_test = data::resolve_dataset("C4_TEST", "");
  if (!std::filesystem::exists(std::string(TITAN_SOURCE_DIR) + "/assets/c4_test")) {
    EXPECT_EQ(c4_test.path, corpus.path);
  }
  EXPECT_EQ(data::resolve_dataset("c4", dir.path()).kind, "text");
  test::write_file(dir / "one.jsonl", test::jsonl({"x"}));
  data::tokenize_to_shards(dir / "one.jsonl", tok, dir / "shards");
  EXPECT_EQ(data::resolve_dataset("c4", dir / "shards").kind, "shards");

  // The bundled corpus reads as English text with BOS/EOS.
  DataConfig c = config("", 2, 256);
  c.dataset = "titan_corpus";
  auto loader = data::make_dataloader(c, tok);
  Batch b = loader->next();
  EXPECT_EQ(b.inputs[0][0].item<int64_t>(), test::ByteTokenizer::kBos);
  std::vector<int32_t> ids(b.inputs[0].data_ptr<int64_t>() + 1, b.inputs[0].data_ptr<int64_t>() + 256);
  std::string words = tok.decode(ids);
  EXPECT_NE(words.find(" the "), std::string::npos) << words;
}

TEST(DataLoader, EmptyDataIsAnError) {
  test::TempDir dir;
  test::write_file(dir / "empty.jsonl", "\n\n");
  test::ByteTokenizer tok;
  EXPECT_THROW(data::make_dataloader(config(dir / "empty.jsonl", 1, 4), tok), UserError);
  test::write_file(dir / "blank_docs.jsonl", test::jsonl({"", ""}));
  test::ByteTokenizerNoSpecials bare;  // empty documents give no tokens without BOS/EOS
  EXPECT_THROW(data::make_dataloader(config(dir / "blank_docs.jsonl", 1, 4), bare), UserError);
  EXPECT_NO_THROW(data::make_dataloader(config(dir / "blank_docs.jsonl", 1, 4), tok));
  EXPECT_THROW(data::make_dataloader(config(dir / "blank_docs.jsonl", 0, 4), tok), UserError);
  EXPECT_THROW(data::make_dataloader(config(dir / "blank_docs.jsonl", 1, 4, 2, 2), tok), UserError);
  EXPECT_THROW(data::make_dataloader(config(dir / "blank_docs.jsonl", 1, 0), tok), UserError);
}

}  // namespace
}  // namespace titan
