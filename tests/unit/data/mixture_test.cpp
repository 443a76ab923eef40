// Weighted mixtures (training.dataset_mix): the shares hold at every step (within one sample of the
// weights), each source serves its own windows in order, data-parallel ranks together read the single
// process's batches, and resuming (in another layout too) is exact.
#include "data/data_test_util.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/data/dataloader.h"
#include "titan/components/data/mixture.h"
#include "titan/components/data/token_files.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

namespace titan {
namespace {

namespace fs = std::filesystem;

// An llm.c token file of n ids within [lo, lo + span): each source of a test mixture gets its own range,
// so that a sample's first token says which source it came from.
void write_llmc(const std::string& path, int n, int lo, int span) {
  test::write_llmc_gpt2(path, n, [&](int i) { return lo + (i * 7 + i / 5) % span; });
}

data::DataConfig config(const std::vector<std::string>& mix, int64_t batch, int64_t seq_len, int rank = 0,
                        int world = 1) {
  data::DataConfig c = test::config("", batch, seq_len, rank, world);
  c.dataset_mix = mix;
  return c;
}

struct Fixture {
  test::TempDir dir;
  test::ByteTokenizer tok;  // 258 ids
  std::vector<std::string> mix;
  Fixture() {
    write_llmc(dir / "a.bin", 1000, 0, 80);
    write_llmc(dir / "b.bin", 333, 80, 80);
    write_llmc(dir / "c.bin", 97, 160, 80);
    mix = {"0.5 " + (dir / "a.bin"), "0.3 bee=" + (dir / "b.bin"), "0.2 " + (dir / "c.bin")};
  }
};

int origin(int64_t first_token) { return static_cast<int>(first_token / 80); }

TEST(DataMixture, SharesHoldAtEveryStepAndEachSourceServesItsOwnWindows) {
  Fixture f;
  const int64_t S = 15;
  auto loader = data::make_dataloader(config(f.mix, 1, S), f.tok);
  EXPECT_NE(loader->description().find("mixture of a.bin (weight 0.5, llm.c token files from"), std::string::npos)
      << loader->description();
  // Each source alone, read in order: what the mixture must serve from it.
  std::vector<std::unique_ptr<data::LlmcWindowSource>> alone;
  for (const char* name : {"a.bin", "b.bin", "c.bin"})
    alone.push_back(std::make_unique<data::LlmcWindowSource>(f.dir / name, f.tok.vocab_size(), S));
  const double weights[3] = {0.5, 0.3, 0.2};
  int64_t counts[3] = {0, 0, 0};
  std::vector<int32_t> expected(static_cast<size_t>(S + 1));
  for (int k = 1; k <= 1000; ++k) {
    const data::Batch b = loader->next();
    const int src = origin(b.inputs[0][0].item<int64_t>());
    ASSERT_GE(src, 0);
    ASSERT_LT(src, 3);
    ++counts[src];
    alone[static_cast<size_t>(src)]->read(expected.data());
    for (int64_t t = 0; t < S; ++t)
      ASSERT_EQ(b.inputs[0][t].item<int64_t>(), expected[static_cast<size_t>(t)]) << "sample " << k << " token " << t;
    ASSERT_EQ(b.labels[0][S - 1].item<int64_t>(), expected[static_cast<size_t>(S)]);
    // The stated bound: every source within one sample of its share, after every sample.
    for (int i = 0; i < 3; ++i)
      ASSERT_LE(std::abs(static_cast<double>(counts[i]) - weights[i] * k), 1.0) << "source " << i << " after " << k;
  }
  EXPECT_EQ(counts[0], 500);
  EXPECT_EQ(counts[1], 300);
  EXPECT_EQ(counts[2], 200);
  const auto tokens = loader->tokens_by_source();
  ASSERT_EQ(tokens.size(), 3u);
  EXPECT_EQ(tokens[0], std::make_pair(std::string("a.bin"), int64_t{500 * S}));
  EXPECT_EQ(tokens[1], std::make_pair(std::string("bee"), int64_t{300 * S}));
  EXPECT_EQ(tokens[2], std::make_pair(std::string("c.bin"), int64_t{200 * S}));
  // The mixture's epoch is the least of its sources': a.bin's 8 passes (500 windows of 16 of its 1000
  // tokens), where b.bin made 14 and c.bin 32.
  EXPECT_EQ(loader->epoch(), 8);
}

TEST(DataMixture, RanksReadTheSingleProcessBatchesAndResumeInAnotherLayoutIsExact) {
  Fixture f;
  // A text source too: the bundled-corpus-like byte stream of a JSON Lines file.
  test::write_file(f.dir / "text.jsonl", test::jsonl({"alpha beta", "gamma", "a longer document of text"}));
  std::vector<std::string> mix = f.mix;
  mix.push_back("0.25 " + (f.dir / "text.jsonl"));
  const int64_t S = 9;
  auto one = data::make_dataloader(config(mix, 4, S), f.tok);
  auto r0 = data::make_dataloader(config(mix, 2, S, 0, 2), f.tok);
  auto r1 = data::make_dataloader(config(mix, 2, S, 1, 2), f.tok);
  for (int step = 0; step < 30; ++step) {
    const data::Batch whole = one->next(), a = r0->next(), b = r1->next();
    ASSERT_TRUE(at::equal(whole.inputs, at::cat({a.inputs, b.inputs}))) << "step " << step;
    ASSERT_TRUE(at::equal(whole.labels, at::cat({a.labels, b.labels}))) << "step " << step;
  }
  EXPECT_EQ(r0->state(), one->state());  // the state is the global stream's, the same on every rank
  // Resume: the saved state of the single process, loaded by 4 ranks of batch 1 and by 1 of batch 4.
  const std::string state = one->state();
  std::vector<std::unique_ptr<data::DataLoader>> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.push_back(data::make_dataloader(config(mix, 1, S, r, 4), f.tok));
    ranks.back()->load_state(state);
  }
  auto again = data::make_dataloader(config(mix, 4, S), f.tok);
  again->load_state(state);
  for (int step = 0; step < 25; ++step) {
    const data::Batch whole = one->next(), same = again->next();
    ASSERT_TRUE(at::equal(whole.inputs, same.inputs)) << "step " << step;
    std::vector<at::Tensor> parts;
    for (auto& r : ranks) parts.push_back(r->next().inputs);
    ASSERT_TRUE(at::equal(whole.inputs, at::cat(parts))) << "step " << step;
  }
  EXPECT_EQ(again->state(), one->state());
}

// A text source's own field ("text_field=FIELD" after its path): each source of the mixture serves
// the windows it serves alone with that field, the others keep the section's field.
TEST(DataMixture, EachTextSourceReadsItsOwnField) {
  Fixture f;
  test::write_file(f.dir / "web.jsonl", test::jsonl({"alpha beta gamma", "delta", "epsilon zeta eta theta"}));
  // The code source holds a `text` field too (other text): the mixture must read `content`.
  std::string code;
  const std::vector<std::string> sources = {"int main() { return 0; }", "def f(x):\n    return x", "fn g() {}"};
  for (size_t i = 0; i < sources.size(); ++i)
    code += nlohmann::json{{"text", "not this " + std::to_string(i)}, {"content", sources[i]}}.dump() + "\n";
  test::write_file(f.dir / "code.jsonl", code);
  const std::vector<std::string> mix = {"0.5 " + (f.dir / "web.jsonl"),
                                        "0.5 stack=" + (f.dir / "code.jsonl") + "  text_field=content "};
  const auto parsed = data::parse_dataset_mix(mix, "training.dataset_mix");
  ASSERT_EQ(parsed.size(), 2u);
  EXPECT_EQ(parsed[0].text_field, "");
  EXPECT_EQ(parsed[1].name, "stack");
  EXPECT_EQ(parsed[1].location, f.dir / "code.jsonl");
  EXPECT_EQ(parsed[1].text_field, "content");

  const int64_t S = 7;
  auto mixed = data::make_dataloader(config(mix, 1, S), f.tok);
  EXPECT_NE(mixed->description().find("stack (weight 0.5, text from " + (f.dir / "code.jsonl") + ", field content)"),
            std::string::npos) << mixed->description();
  auto web = data::make_dataloader(test::config(f.dir / "web.jsonl", 1, S), f.tok);
  data::DataConfig code_alone = test::config(f.dir / "code.jsonl", 1, S);
  code_alone.text_field = "content";
  auto stack = data::make_dataloader(code_alone, f.tok);
  // Equal weights alternate, the first source first.
  for (int k = 0; k < 40; ++k) {
    const data::Batch got = mixed->next(), want = (k % 2 == 0 ? web : stack)->next();
    ASSERT_TRUE(at::equal(got.inputs, want.inputs)) << "sample " << k;
    ASSERT_TRUE(at::equal(got.labels, want.labels)) << "sample " << k;
  }

  // Resuming reads the same field: the state says which.
  const std::string state = mixed->state();
  auto again = data::make_dataloader(config(mix, 1, S), f.tok);
  again->load_state(state);
  for (int k = 0; k < 5; ++k) ASSERT_TRUE(at::equal(again->next().inputs, mixed->next().inputs)) << "resumed " << k;
  auto error = test::error_of;
  std::vector<std::string> other_field = mix;
  other_field[1] = "0.5 stack=" + (f.dir / "code.jsonl");
  std::string e = error([&] { data::make_dataloader(config(other_field, 1, S), f.tok)->load_state(state); });
  EXPECT_NE(e.find("the data loader state was saved reading the text of the field 'content', this run reads 'text'"),
            std::string::npos) << e;
  e = error([&] { data::parse_dataset_mix({"1 " + (f.dir / "code.jsonl") + " text_field="}, "training.dataset_mix"); });
  EXPECT_NE(e.find("text_field= names no field"), std::string::npos) << e;
  e = error([&] { data::make_dataloader(config({"1 " + (f.dir / "a.bin") + " text_field=content"}, 1, S), f.tok); });
  EXPECT_NE(e.find("training.dataset_mix source 'a.bin' (llm.c token files) is already tokenized: text_field=content "
                   "applies to text sources only"),
            std::string::npos) << e;
  e = error([&] { data::parse_dataset_mix({"1 text_field=content"}, "training.dataset_mix"); });
  EXPECT_NE(e.find("names a text field but no dataset"), std::string::npos) << e;
  // A field whose name holds a blank, in double quotes; its source reads as alone with that field.
  std::string spaced;
  for (size_t i = 0; i < sources.size(); ++i)
    spaced += nlohmann::json{{"text", "not this"}, {"body text", sources[i]}}.dump() + "\n";
  test::write_file(f.dir / "spaced.jsonl", spaced);
  const auto quoted = data::parse_dataset_mix({"1 " + (f.dir / "spaced.jsonl") + "\ttext_field=\"body text\""}, "m");
  ASSERT_EQ(quoted.size(), 1u);
  EXPECT_EQ(quoted[0].location, f.dir / "spaced.jsonl");
  EXPECT_EQ(quoted[0].text_field, "body text");
  auto spaced_mix = data::make_dataloader(config({"1 " + (f.dir / "spaced.jsonl") + " text_field=\"body text\""}, 1, S), f.tok);
  auto stack_again = data::make_dataloader(code_alone, f.tok);
  for (int k = 0; k < 6; ++k) ASSERT_TRUE(at::equal(spaced_mix->next().inputs, stack_again->next().inputs)) << k;
  e = error([&] { data::parse_dataset_mix({"1 " + (f.dir / "spaced.jsonl") + " text_field=\"body text"}, "m"); });
  EXPECT_NE(e.find("text_field=\" needs its closing quote, ending the entry"), std::string::npos) << e;
  e = error([&] { data::parse_dataset_mix({"1 " + (f.dir / "spaced.jsonl") + " text_field=\"body\"text\""}, "m"); });
  EXPECT_NE(e.find("a quoted text_field=\"FIELD\" holds no double quote"), std::string::npos) << e;
  // A quoted field inside a path is not the entry's: its last word is.
  const auto inner = data::parse_dataset_mix({"1 /d/a text_field=\"x\"/c.jsonl text_field=body"}, "m");
  EXPECT_EQ(inner[0].location, "/d/a text_field=\"x\"/c.jsonl");
  EXPECT_EQ(inner[0].text_field, "body");
  e = error([&] { data::parse_dataset_mix({"1 " + (f.dir / "spaced.jsonl") + " text_field=\"\""}, "m"); });
  EXPECT_NE(e.find("text_field= names no field"), std::string::npos) << e;
  // A field the source lacks names the way to set it.
  e = error([&] { data::make_dataloader(config({"1 " + (f.dir / "web.jsonl") + " text_field=body"}, 1, S), f.tok)->next(); });
  EXPECT_NE(e.find("in a dataset_mix entry, text_field=FIELD after the path"), std::string::npos) << e;
}

TEST(DataMixture, BadEntriesAndAnotherMixturesStateAreClearErrors) {
  Fixture f;
  auto error = test::error_of;
  std::string e = error([&] { data::parse_dataset_mix({"abc " + (f.dir / "a.bin")}, "training.dataset_mix"); });
  EXPECT_NE(e.find("training.dataset_mix entry 'abc " + (f.dir / "a.bin") + "': the weight 'abc' is not a positive number"),
            std::string::npos) << e;
  e = error([&] { data::parse_dataset_mix({"-1 x"}, "training.dataset_mix"); });
  EXPECT_NE(e.find("the weight '-1' is not a positive number"), std::string::npos) << e;
  e = error([&] { data::parse_dataset_mix({"0.5"}, "training.dataset_mix"); });
  EXPECT_NE(e.find("needs a weight and a dataset"), std::string::npos) << e;
  // A Hive-style folder ("lang=en") that exists is a path; NAME=PATH otherwise.
  std::filesystem::create_directories(f.dir / "lang=en");
  const std::string cwd = std::filesystem::current_path();
  std::filesystem::current_path(f.dir.path());
  const auto hive = data::parse_dataset_mix({"1 lang=en/", "2 web=lang=en"}, "training.dataset_mix");
  std::filesystem::current_path(cwd);
  ASSERT_EQ(hive.size(), 2u);
  EXPECT_EQ(hive[0].name, "lang=en");
  EXPECT_EQ(hive[0].location, "lang=en/");
  EXPECT_EQ(hive[1].name, "web");
  EXPECT_EQ(hive[1].location, "lang=en");
  e = error([&] { data::parse_dataset_mix({"1 d1/x.bin", "1 d2/x.bin"}, "training.dataset_mix"); });
  EXPECT_NE(e.find("two sources named 'x.bin': name them apart"), std::string::npos) << e;
  e = error([&] { data::make_dataloader(config({"1 " + (f.dir / "a.bin"), "1 gone=" + (f.dir / "nowhere")}, 1, 8), f.tok); });
  EXPECT_NE(e.find("training.dataset_mix source 'gone': dataset 'c4': path '" + (f.dir / "nowhere") + "' does not exist"),
            std::string::npos) << e;
  data::DataConfig both = config(f.mix, 1, 8);
  both.dataset_path = f.dir / "a.bin";
  e = error([&] { data::make_dataloader(both, f.tok); });
  EXPECT_NE(e.find("training.dataset_mix and training.dataset_path are both set"), std::string::npos) << e;
  // The state of another mixture (other weights) is refused, naming both.
  auto a = data::make_dataloader(config(f.mix, 1, 8), f.tok);
  a->next();
  std::vector<std::string> other = f.mix;
  other[0] = "0.6 " + (f.dir / "a.bin");
  e = error([&] { data::make_dataloader(config(other, 1, 8), f.tok)->load_state(a->state()); });
  EXPECT_NE(e.find("the data loader state was saved for the mixture 0.5 a.bin 0.3 bee 0.2 c.bin, this run mixes 0.6 "
                   "a.bin 0.3 bee 0.2 c.bin"),
            std::string::npos) << e;
}

}  // namespace
}  // namespace titan
