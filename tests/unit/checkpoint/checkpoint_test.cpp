// The checkpoint format on its own: slices written by several "ranks" read back as blocks of any
// other split, checksums that catch a flipped byte or a truncated file (naming it), errors that name
// the tensor, and staging that modifies nothing on failure.
#include "fake_ranks.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/components/checkpoint/checkpoint.h"
#include "titan/components/checkpoint/checkpointer.h"
#include "titan/components/checkpoint/file_io.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace titan::checkpoint {
namespace {

namespace fs = std::filesystem;


nlohmann::json info() { return {{"step", 3}, {"model", {{"name", "toy"}, {"flavor", "x"}}}, {"contents", {"model"}}}; }

// Writes `full` (7 x 5, so 3 ranks hold 3, 3 and 1 rows) sharded on dim 0 over `world` ranks, with
// replicas when `replicas` > 1 (one tensor per rank: the writer chosen for it is the first replica).
void write_sharded(const std::string& dir, const at::Tensor& full, int world, int replicas = 1) {
  std::vector<std::string> all(static_cast<size_t>(world * replicas));
  for (int r = world * replicas - 1; r >= 0; --r) {  // rank 0 last: it writes the index
    const int shard = r % world, replica = r / world;
    dist::Placement p;
    p.global_shape = full.sizes().vec();
    p.shards.push_back(dist::chunk("dp_shard", 0, full.size(0), shard, world));
    p.replicated = {"dp_replicate"};
    at::Tensor local = at::zeros({p.shards[0].local_size, full.size(1)});
    local.narrow(0, 0, p.shards[0].length).copy_(full.narrow(0, p.shards[0].offset, p.shards[0].length));
    std::vector<dist::PlacedTensor> tensors = {{"model.w", local, p}};
    assign_writers(tensors, [&](const std::string&) { return std::pair<int, int>(replica, replicas); });
    Snapshot snap = take_snapshot(tensors);
    snap.info = info();
    FakeRanks coord(r, world * replicas, &all);
    write(dir, snap, coord);
  }
}

TEST(Checkpoint, SlicesOfOneSplitReadBackUnderAnother) {
  test::TempDir dir;
  const at::Tensor full = at::arange(35, at::kFloat).view({7, 5});
  write_sharded(dir / "step-3", full, 3, /*replicas=*/2);
  // Replicas are written once: 3 files, not 6 (one tensor: the first replica writes it).
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir / "step-3")) files += e.path().extension() == ".safetensors";
  EXPECT_EQ(files, 3);
  Reader reader(dir / "step-3");
  EXPECT_EQ(reader.info().at("step"), 3);
  ASSERT_TRUE(reader.meta("model.w"));
  EXPECT_EQ(reader.meta("model.w")->shape, (std::vector<int64_t>{7, 5}));
  // Blocks crossing the saved slices, as 2 and 4 ranks (and one process) would read them.
  EXPECT_TRUE(at::equal(reader.read("model.w", {0, 0}, {7, 5}), full));
  EXPECT_TRUE(at::equal(reader.read("model.w", {2, 0}, {4, 5}), full.narrow(0, 2, 4)));
  EXPECT_TRUE(at::equal(reader.read("model.w", {6, 1}, {1, 3}), full.narrow(0, 6, 1).narrow(1, 1, 3)));
  reader.verify_all();
  // Staged into a 4-way split: rank 3 holds rows 6 and a padding row.
  dist::Placement p;
  p.global_shape = {7, 5};
  p.shards.push_back(dist::chunk("dp_shard", 0, 7, 3, 4));
  at::Tensor local = at::full({2, 5}, -1.0f);
  check(reader, {{"model.w", local, p}}, false);
  EXPECT_EQ(local[0][0].item<float>(), -1.0f);  // a check modifies nothing
  load_into(reader, {{"model.w", local, p}}, false);
  EXPECT_TRUE(at::equal(local[0], full[6]));
  EXPECT_TRUE(at::equal(local[1], at::zeros({5})));
  // The files are plain safetensors: the generic reader opens them.
  auto file = safetensors::load(dir / "step-3/rank-00002.safetensors");
  EXPECT_TRUE(at::equal(file.tensors.at("model.w"), full.narrow(0, 6, 1)));
  EXPECT_NE(file.metadata.at("titan_slices").find("\"begin\":[6,0]"), std::string::npos) << file.metadata.at("titan_slices");
}

void expect_user_error(const std::function<void()>& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const UserError& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, AFlippedByteIsCaughtByItsChecksumAndNamesTheFile) {
  test::TempDir dir;
  const at::Tensor full = at::randn({7, 5});
  write_sharded(dir / "step-3", full, 3);
  const std::string victim = dir / "step-3/rank-00001.safetensors";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    char c;
    f.read(&c, 1);
    c ^= 0x10;
    f.seekp(-3, std::ios::end);
    f.write(&c, 1);
  }
  Reader reader(dir / "step-3");
  expect_user_error([&] { reader.read("model.w", {0, 0}, {7, 5}); }, {victim, "corrupt", "model.w"});
  expect_user_error([&] { Reader(dir / "step-3").verify_all(); }, {victim, "CRC-32"});
  // A block that does not touch the damaged slice still reads.
  EXPECT_TRUE(at::equal(reader.read("model.w", {0, 0}, {3, 5}), full.narrow(0, 0, 3)));
}

TEST(Checkpoint, ATruncatedFileNamesTheFile) {
  test::TempDir dir;
  write_sharded(dir / "step-3", at::randn({7, 5}), 3);
  const std::string victim = dir / "step-3/rank-00000.safetensors";
  fs::resize_file(victim, fs::file_size(victim) - 10);
  Reader reader(dir / "step-3");
  expect_user_error([&] { reader.read("model.w", {0, 0}, {7, 5}); }, {victim, "truncated"});
}

TEST(Checkpoint, MismatchesNameTheTensorAndACheckModifiesNothing) {
  test::TempDir dir;
  write_single_process(dir / "step-1", {{"model.a", at::ones({4})}, {"model.b", at::ones({2, 3})}}, info());
  Reader reader(dir / "step-1");
  at::Tensor a = at::zeros({4}), b = at::zeros({3, 2}), c = at::zeros({1});
  expect_user_error([&] { check(reader, {{"model.a", a, dist::whole(a)}, {"model.b", b, dist::whole(b)}}, false); },
                    {"model.b", "[2, 3]", "[3, 2]"});
  expect_user_error([&] { check(reader, {{"model.a", a, dist::whole(a)}, {"model.c", c, dist::whole(c)}}, false); },
                    {"model.c", "has no tensor"});
  at::Tensor d = at::zeros({4}, at::kDouble);
  expect_user_error([&] { check(reader, {{"model.a", d, dist::whole(d)}}, false); }, {"model.a", "Float", "Double"});
  EXPECT_EQ(a.sum().item<double>(), 0.0);  // failed checks leave the destination untouched
  check(reader, {{"model.a", d, dist::whole(d)}}, /*allow_cast=*/true);
  load_into(reader, {{"model.a", d, dist::whole(d)}}, /*allow_cast=*/true);
  EXPECT_EQ(d.sum().item<double>(), 4.0);
}

TEST(Checkpoint, OneProcessStreamsTensorsIntoSeveralFiles) {
  test::TempDir dir;
  std::map<std::string, at::Tensor> tensors;
  for (int i = 0; i < 5; ++i) tensors["model.t" + std::to_string(i)] = at::randn({10, 10});  // 400 bytes each
  std::vector<std::string> names, fetched;
  for (const auto& [n, t] : tensors) names.push_back(n);
  write_single_process(dir / "step-0", names, [&](const std::string& n) {
    fetched.push_back(n);
    return tensors.at(n);
  }, info(), nlohmann::json::object(), /*max_file_bytes=*/900);
  EXPECT_EQ(fetched, names);  // each fetched once, in order
  Reader r(dir / "step-0");
  r.verify_all();
  EXPECT_EQ(r.names(), names);
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir / "step-0")) files += e.path().extension() == ".safetensors";
  EXPECT_EQ(files, 3);  // 2 + 2 + 1 tensors
  for (const auto& [n, t] : tensors) EXPECT_TRUE(at::equal(r.read(n, {0, 0}, {10, 10}), t)) << n;
}

TEST(Checkpoint, OnlyCompleteFoldersAreListed) {
  test::TempDir dir;
  write_single_process(dir / "step-2", {{"model.a", at::ones({4})}}, info());
  write_single_process(dir / "step-10", {{"model.a", at::ones({4})}}, info());
  fs::create_directories(dir / "step-12.partial");
  fs::create_directories(dir / "step-11");  // no index: not complete
  auto all = list_checkpoints(dir.path());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all.begin()->first, 2);
  EXPECT_EQ(all.rbegin()->first, 10);
  expect_user_error([&] { Reader r(dir / "step-11"); }, {"step-11", "index.json"});
}

TEST(Checkpoint, ACrashWhileReplacingAStepIsRepairedByTheNextRun) {
  // A save of step 4 again moved the old step-4 aside and crashed before renaming the new one in.
  for (const bool new_complete : {true, false}) {
    test::TempDir dir;
    write_single_process(dir / "step-4", {{"model.a", at::ones({4})}}, info());
    write_single_process(dir / "step-4.partial", {{"model.a", at::full({4}, 2.0f)}}, info());
    fs::rename(dir / "step-4", dir / "step-4.old");
    if (!new_complete) fs::remove(dir / "step-4.partial/index.json");
    config::Checkpoint cfg;
    cfg.enable = true;
    std::vector<std::string> logs;
    Checkpointer ck(cfg, dir.path(), single_process_coordinator(), [&](const std::string& m) { logs.push_back(m); });
    auto all = list_checkpoints(dir.path());
    ASSERT_EQ(all.size(), 1u) << new_complete;
    Reader r(all.at(4));
    EXPECT_EQ(r.read("model.a", {0}, {4})[0].item<float>(), new_complete ? 2.0f : 1.0f);
    EXPECT_FALSE(fs::exists(dir / "step-4.old"));
    EXPECT_FALSE(fs::exists(dir / "step-4.partial"));
    EXPECT_FALSE(logs.empty());
  }
}

TEST(Checkpoint, ADamagedTrainingStateInTheIndexIsCaught) {
  test::TempDir dir;
  write_single_process(dir / "step-1", {{"model.a", at::ones({4})}}, info(), {{"train_state", {{"step", 1}}}});
  std::string text = read_file(dir / "step-1/index.json");
  const auto at = text.find("\"step\": 1");
  ASSERT_NE(at, std::string::npos) << text;
  const std::string good = text;
  text.replace(at, 9, "\"step\": 7");
  std::ofstream(dir / "step-1/index.json") << text;
  expect_user_error([&] { Reader r(dir / "step-1"); }, {"index.json", "CRC-32"});
  // The info (contents, model, step) is covered too.
  text = good;
  text.replace(text.find("\"toy\""), 5, "\"toz\"");
  std::ofstream(dir / "step-1/index.json") << text;
  expect_user_error([&] { Reader r(dir / "step-1"); }, {"index.json", "CRC-32"});
}

}  // namespace
}  // namespace titan::checkpoint
