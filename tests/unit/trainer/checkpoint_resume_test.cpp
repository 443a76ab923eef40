// Checkpoints in training: a run stopped and resumed equals the uninterrupted run (bitwise in one
// process and under FSDP 2; within 1e-5 relative when resumed under another layout, the data
// position included), background saves, the [checkpoint] keys, crash safety and corrupt files.
//
// Runs train the debug model for 12 steps (seq_len 32, global batch 12, learning-rate schedule over 12
// steps so that a run stopped after 6 has the same schedule), saving at step 6.
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/common/memory_tracker.h"
#include "titan/components/checkpoint/checkpoint.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/config/job_config.h"
#include "titan/trainer/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <numeric>
#include <fstream>

namespace titan {
namespace {

namespace fs = std::filesystem;
const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";

std::vector<std::string> base_args(const std::string& dump, int steps) {
  return {"--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder", dump,
          "--model.hf_assets_path", kSource + "/assets/tokenizer", "--training.seq_len", "32",
          "--training.global_batch_size", "12", "--training.steps", std::to_string(steps),
          "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.total_steps", "12", "--metrics.log_freq", "100",
          "--checkpoint.enable", "--checkpoint.interval", "6", "--checkpoint.last_save_model_only", "false"};
}

JobConfig config(const std::string& dump, int steps, std::vector<std::string> extra = {}) {
  auto args = base_args(dump, steps);
  args.insert(args.end(), {"--training.local_batch_size", "12"});
  args.insert(args.end(), extra.begin(), extra.end());
  return parse_config(args);
}

// ---- one process, in this process

const std::vector<double>& straight_losses() {
  static std::vector<double> losses = [] {
    test::TempDir dir;
    Trainer t(config(dir.path(), 12));
    return t.train();
  }();
  return losses;
}

TEST(CheckpointResume, SingleProcessStoppedAndResumedIsBitwiseTheUninterruptedRun) {
  test::TempDir dir;
  std::vector<double> first = Trainer(config(dir.path(), 6)).train();
  Trainer resumed(config(dir.path(), 12));
  EXPECT_EQ(resumed.step(), 6);
  std::vector<double> rest = resumed.train();
  first.insert(first.end(), rest.begin(), rest.end());
  ASSERT_EQ(first.size(), 12u);
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(first[i], straight_losses()[i]) << "step " << i + 1;
  EXPECT_EQ(resumed.tokens_seen(), 12 * 12 * 32);
}

TEST(CheckpointResume, AsyncSavesGiveTheSameLosses) {
  for (const std::string mode : {"async", "async_with_pinned_mem"}) {
    test::TempDir dir;
    // Saves every 2 steps overlap the following steps; the last one is waited for.
    std::vector<double> first = Trainer(config(dir.path(), 6, {"--checkpoint.async_mode", mode, "--checkpoint.interval", "2"})).train();
    auto saved = checkpoint::list_checkpoints(dir / "checkpoint");
    ASSERT_EQ(saved.size(), 3u) << mode;
    Trainer resumed(config(dir.path(), 12, {"--checkpoint.async_mode", mode}));
    std::vector<double> rest = resumed.train();
    first.insert(first.end(), rest.begin(), rest.end());
    for (size_t i = 0; i < 12; ++i) EXPECT_EQ(first[i], straight_losses()[i]) << mode << " step " << i + 1;
  }
}

TEST(CheckpointResume, AFailedBackgroundSaveStopsTheRunWithItsError) {
  test::TempDir dir;
  Trainer t(config(dir.path(), 12, {"--checkpoint.async_mode", "async", "--checkpoint.interval", "2"}));
  // The checkpoint folder (created at start-up, where every rank checked that it sees it) is gone and
  // cannot be created again: a file is in its place.
  fs::remove_all(dir / "checkpoint");
  std::ofstream(dir / "checkpoint") << "not a folder";
  try {
    t.train();
    ADD_FAILURE() << "training went on after a failed save";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("background checkpoint save failed"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(dir / "checkpoint/step-2.partial"), std::string::npos) << e.what();
  }
  // The failure surfaces at the first step boundary after the write failed, at the latest when the
  // next save (step 4) waits for it: never at the end of the run.
  EXPECT_GE(t.step(), 2);
  EXPECT_LE(t.step(), 4);
}

TEST(CheckpointResume, KeepLatestKKeepsExactlyK) {
  test::TempDir dir;
  Trainer(config(dir.path(), 7, {"--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "3"})).train();
  auto saved = checkpoint::list_checkpoints(dir / "checkpoint");
  ASSERT_EQ(saved.size(), 3u);
  EXPECT_EQ(saved.begin()->first, 5);
  EXPECT_EQ(saved.rbegin()->first, 7);
  // The older ones deleted (in the background) by the time the run ends: no step-N.deleting left.
  std::vector<std::string> entries;
  for (const auto& e : std::filesystem::directory_iterator(dir / "checkpoint")) entries.push_back(e.path().filename());
  EXPECT_EQ(entries.size(), 3u) << ::testing::PrintToString(entries);
}

TEST(CheckpointResume, KeepLatestKAfterLoadStepKeepsWhatThisRunSaved) {
  test::TempDir dir;
  Trainer(config(dir.path(), 8, {"--checkpoint.interval", "2"})).train();  // steps 2, 4, 6, 8
  Trainer t(config(dir.path(), 4, {"--checkpoint.load_step", "2", "--checkpoint.interval", "2",
                                   "--checkpoint.keep_latest_k", "2"}));
  EXPECT_EQ(t.step(), 2);
  t.train();  // saves step 4 again
  auto saved = checkpoint::list_checkpoints(dir / "checkpoint");
  for (int64_t s : {2, 4, 6, 8}) EXPECT_TRUE(saved.count(s)) << "step-" << s;  // 2 and 4 are the newest two of this run
  EXPECT_EQ(checkpoint::Reader(saved.at(4)).state().at("train_state").at("step"), 4);
}

TEST(CheckpointResume, TheFolderNameChoosesAndLoadOnlyLeavesTheFolderAlone) {
  test::TempDir dir;
  Trainer(config(dir.path(), 6, {"--checkpoint.interval", "2"})).train();  // steps 2, 4, 6
  fs::remove_all(dir / "checkpoint/step-6");
  fs::rename(dir / "checkpoint/step-4", dir / "checkpoint/step-5");  // a renamed copy
  fs::create_directories(dir / "checkpoint/step-9.partial");         // another job's save in progress
  {
    Trainer t(config(dir.path(), 12, {"--checkpoint.load_only"}));
    EXPECT_EQ(t.step(), 4);  // the folder step-5 was chosen; its content is step 4
    t.train();
  }
  EXPECT_TRUE(fs::exists(dir / "checkpoint/step-9.partial"));  // load_only touches nothing
  Trainer u(config(dir.path(), 12));
  EXPECT_FALSE(fs::exists(dir / "checkpoint/step-9.partial"));  // a saving run cleans up
}

TEST(CheckpointResume, LoadStepAndExcludeFromLoading) {
  test::TempDir dir;
  Trainer(config(dir.path(), 6, {"--checkpoint.interval", "3"})).train();
  {
    Trainer t(config(dir.path(), 12, {"--checkpoint.load_step", "3"}));
    EXPECT_EQ(t.step(), 3);
    std::vector<double> rest = t.train();
    EXPECT_EQ(rest[0], straight_losses()[3]);
  }
  // Without the data position the run restarts the data (and without train_state the step).
  test::TempDir other;
  Trainer(config(other.path(), 6)).train();
  Trainer t(config(other.path(), 12, {"--checkpoint.exclude_from_loading", "dataloader,train_state,lr_scheduler"}));
  EXPECT_EQ(t.step(), 0);
  checkpoint::Reader saved(other / "checkpoint/step-6");
  for (const auto& p : t.parameters())  // the model was loaded
    EXPECT_TRUE(at::equal(p.local, saved.read("model." + p.name, std::vector<int64_t>(p.local.dim(), 0),
                                              p.placement.global_shape))) << p.name;
  EXPECT_DOUBLE_EQ(t.train_step().lr, 8e-4 * 0.5);  // the schedule restarts: warmup step 1 of 2
  // The schedule is its own part: kept while the step count restarts.
  Trainer u(config(other.path(), 12, {"--checkpoint.exclude_from_loading", "train_state"}));
  EXPECT_EQ(u.step(), 0);
  const double lr7 = u.train_step().lr;
  Trainer v(config(other.path(), 12));
  EXPECT_EQ(v.step(), 6);
  EXPECT_DOUBLE_EQ(lr7, v.train_step().lr);  // both at the schedule's step 7
  EXPECT_THROW(Trainer(config(other.path(), 12, {"--checkpoint.exclude_from_loading", "optimiser"})), UserError);
}

TEST(CheckpointResume, SeedCheckpointAndModelOnlyLastSave) {
  test::TempDir dir;
  auto cfg = config(dir.path(), 2, {"--checkpoint.create_seed_checkpoint"});
  ASSERT_EQ(run_training(cfg), 0);
  auto saved = checkpoint::list_checkpoints(dir / "checkpoint");
  ASSERT_EQ(saved.size(), 1u);
  ASSERT_EQ(saved.begin()->first, 0);
  checkpoint::Reader seed(saved.begin()->second);
  EXPECT_EQ(seed.info().at("contents"), nlohmann::json({"model"}));
  EXPECT_EQ(seed.meta("model.tok_embeddings.weight")->dtype, at::kFloat);
  // A run in that folder starts from the seed: same losses as a run without it (same seed).
  // A run in that folder with another seed starts from the seed checkpoint's weights: the losses of
  // the seed-0 run, not of its own seed.
  test::TempDir plain, other_seed;
  auto a = Trainer(config(dir.path(), 2, {"--checkpoint.last_save_model_only", "true", "--checkpoint.export_dtype",
                                          "bfloat16", "--debug.seed", "5"})).train();
  auto b = Trainer(config(plain.path(), 2, {"--checkpoint.enable", "false"})).train();
  auto c = Trainer(config(other_seed.path(), 2, {"--checkpoint.enable", "false", "--debug.seed", "5"})).train();
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  // The last save holds only the model, in export_dtype; it is not resumed from.
  checkpoint::Reader last(dir / "checkpoint/step-2");
  EXPECT_EQ(last.info().at("contents"), nlohmann::json({"model"}));
  EXPECT_EQ(last.meta("model.tok_embeddings.weight")->dtype, at::kBFloat16);
  EXPECT_FALSE(last.meta("optimizer.tok_embeddings.weight.exp_avg"));
  Trainer again(config(dir.path(), 4));
  EXPECT_EQ(again.step(), 0);  // resumed from the seed (step 0), not from the export
}

TEST(CheckpointResume, FirstStepCheckpointAndLoadOnly) {
  test::TempDir dir;
  Trainer(config(dir.path(), 2, {"--checkpoint.enable_first_step_checkpoint"})).train();
  auto saved = checkpoint::list_checkpoints(dir / "checkpoint");
  ASSERT_EQ(saved.size(), 2u);  // step 1 and the last step
  EXPECT_EQ(saved.begin()->first, 1);
  // load_only resumes but never saves.
  Trainer t(config(dir.path(), 12, {"--checkpoint.load_only", "--checkpoint.interval", "1"}));
  EXPECT_EQ(t.step(), 2);
  t.train();
  EXPECT_EQ(checkpoint::list_checkpoints(dir / "checkpoint").size(), 2u);
}

TEST(CheckpointResume, InitialLoadPathStartsFromAnotherRunsWeights) {
  test::TempDir first, second, third;
  Trainer(config(first.path(), 6)).train();
  const std::string step6 = first / "checkpoint/step-6";
  // Model only (the default): the weights of step 6, a fresh optimizer, step 1, data from the start.
  Trainer t(config(second.path(), 12, {"--checkpoint.initial_load_path", step6}));
  EXPECT_EQ(t.step(), 0);
  checkpoint::Reader r(step6);
  for (const auto& p : t.parameters()) {
    at::Tensor want = r.read("model." + p.name, std::vector<int64_t>(p.placement.global_shape.size(), 0),
                             p.placement.global_shape);
    EXPECT_TRUE(at::equal(p.local, want)) << p.name;
  }
  // With initial_load_model_only false it is a full resume from that folder.
  Trainer full(config(third.path(), 12, {"--checkpoint.initial_load_path", step6, "--checkpoint.initial_load_model_only",
                                         "false"}));
  EXPECT_EQ(full.step(), 6);
  EXPECT_EQ(full.train()[0], straight_losses()[6]);
  // Once the run's own folder has a checkpoint, that one wins over initial_load_path.
  Trainer again(config(third.path(), 12, {"--checkpoint.initial_load_path", step6}));
  EXPECT_EQ(again.step(), 12);
}

TEST(CheckpointResume, LastSaveInHfAndInitialLoadInHf) {
  test::TempDir dir, next;
  Trainer t(config(dir.path(), 3, {"--checkpoint.last_save_model_only", "true", "--checkpoint.last_save_in_hf"}));
  t.train();
  const auto trained = t.full_parameters();
  const std::string hf = dir / "checkpoint/step-3";
  EXPECT_TRUE(fs::exists(hf + "/config.json"));
  EXPECT_TRUE(fs::exists(hf + "/model.safetensors"));
  EXPECT_TRUE(checkpoint::list_checkpoints(dir / "checkpoint").empty());  // an export, not a resume point
  // A new run starts from the export: the same weights (fp32, the RoPE permutation undone exactly).
  Trainer u(config(next.path(), 12, {"--checkpoint.initial_load_path", hf, "--checkpoint.initial_load_in_hf"}));
  EXPECT_EQ(u.step(), 0);
  const auto loaded = u.full_parameters();
  for (const auto& [name, w] : trained) EXPECT_TRUE(at::equal(loaded.at(name), w)) << name;
  // last_save_in_hf writes only the model, so it needs last_save_model_only.
  EXPECT_THROW(Trainer(config(next.path(), 3, {"--checkpoint.last_save_in_hf"})), UserError);
}

TEST(CheckpointResume, ACorruptCheckpointIsAClearErrorNamingTheFile) {
  test::TempDir dir;
  Trainer(config(dir.path(), 6)).train();
  const std::string victim = dir / "checkpoint/step-6/rank-00000.safetensors";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(victim) / 2));
    f.put('\x5a');
  }
  try {
    Trainer t(config(dir.path(), 12));
    ADD_FAILURE() << "a corrupt checkpoint loaded";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(victim), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("CRC-32"), std::string::npos) << e.what();
  }
  fs::resize_file(victim, 1000);
  try {
    Trainer t(config(dir.path(), 12));
    ADD_FAILURE() << "a truncated checkpoint loaded";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(victim), std::string::npos) << e.what();
  }
}

// ---- several processes, through titan launch

struct LaunchedRun {
  std::vector<double> losses;  // of the steps this run trained
  std::string output;
};

LaunchedRun launch(int nproc, const std::string& dump, int steps, int local_batch, std::vector<std::string> extra = {},
           std::map<std::string, std::string> env = {}) {
  std::vector<std::string> argv = {kTitan, "launch", "--nproc-per-node", std::to_string(nproc), "--master-port", "0",
                                   "--", "train"};
  auto args = base_args(dump, steps);
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), {"--training.local_batch_size", std::to_string(local_batch)});
  argv.insert(argv.end(), extra.begin(), extra.end());
  const bool keep = env.count("TITAN_DEBUG_DUMP_WEIGHTS") > 0;  // the caller reads the weights
  if (!keep) env["TITAN_DEBUG_DUMP_WEIGHTS"] = dump + "/weights-" + std::to_string(::getpid()) + ".safetensors";
  const std::string weights = env.at("TITAN_DEBUG_DUMP_WEIGHTS");
  env["OMP_NUM_THREADS"] = "1";
  auto r = test::run_process(argv, env, std::chrono::seconds(600));
  LaunchedRun out;
  out.output = r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  if (r.exit_code != 0 || !fs::exists(weights)) return out;
  at::Tensor l = safetensors::load(weights).tensors.at("__losses__");
  for (int64_t i = 0; i < l.numel(); ++i) out.losses.push_back(l[i].item<double>());
  if (!keep) fs::remove(weights);
  return out;
}

// Saved once per test process: FSDP 2 trains 6 steps and saves.
const std::string& fsdp2_checkpoint() {
  static test::TempDir dir;
  static bool done = [] {
    // Written in the background (pinned-buffer mode): the store-coordinated save of two ranks.
    auto r = launch(2, dir.path(), 6, 6, {"--checkpoint.async_mode", "async_with_pinned_mem"});
    return !r.losses.empty();
  }();
  EXPECT_TRUE(done);
  return dir.path();
}

// The save at step 12 of a resumed run: every rank wrote a part, and (with replicas) within 10% of an
// equal share, the replicated pieces spread over the replicas rather than all written by the first.
void expect_balanced_writes(const fs::path& step_dir, int nproc) {
  std::vector<int64_t> bytes;
  for (int r = 0; r < nproc; ++r) {
    char name[64];
    std::snprintf(name, sizeof name, "rank-%05d.safetensors", r);
    std::error_code ec;
    const auto b = fs::file_size(step_dir / name, ec);
    EXPECT_FALSE(ec) << "rank " << r << " wrote nothing to " << step_dir;
    bytes.push_back(ec ? 0 : static_cast<int64_t>(b));
  }
  const int64_t total = std::accumulate(bytes.begin(), bytes.end(), int64_t{0});
  for (int r = 0; r < nproc; ++r)
    EXPECT_NEAR(static_cast<double>(bytes[r]), total / static_cast<double>(nproc), 0.1 * total / nproc) << "rank " << r;
}

void expect_resume_matches(int nproc, int local_batch, std::vector<std::string> extra = {}) {
  test::TempDir dir;
  fs::copy(fsdp2_checkpoint() + "/checkpoint", dir / "checkpoint", fs::copy_options::recursive);
  LaunchedRun r = launch(nproc, dir.path(), 12, local_batch, extra);
  EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  ASSERT_EQ(r.losses.size(), 6u) << r.output;
  for (size_t i = 0; i < 6; ++i)
    EXPECT_NEAR(r.losses[i], straight_losses()[6 + i], 1e-5 * straight_losses()[6 + i]) << "step " << 7 + i;
  expect_balanced_writes(dir / "checkpoint/step-12", nproc);
}

TEST(CheckpointReshard, Fsdp2ResumedAsOneProcess) { expect_resume_matches(1, 12); }
TEST(CheckpointReshard, Fsdp2ResumedAsFsdp4) { expect_resume_matches(4, 3); }
TEST(CheckpointReshard, Fsdp2ResumedAsUnevenFsdp3) { expect_resume_matches(3, 4); }
TEST(CheckpointReshard, Fsdp2ResumedAsHsdp2x2) {
  expect_resume_matches(4, 3, {"--parallelism.data_parallel_replicate_degree", "2"});
}
TEST(CheckpointReshard, Fsdp2ResumedAsDdp2) {
  expect_resume_matches(2, 6, {"--parallelism.data_parallel_replicate_degree", "2",
                               "--parallelism.data_parallel_shard_degree", "1"});
}

// Tensor-parallel checkpoints hold TP shards by placement: they resume under any TP degree.
const std::vector<std::string> kTp2 = {"--parallelism.tensor_parallel_degree", "2"};
const std::vector<std::string> kTp4 = {"--parallelism.tensor_parallel_degree", "4"};

std::string saved_under(int nproc, int local_batch, const std::vector<std::string>& layout, const test::TempDir& dir) {
  auto r = launch(nproc, dir.path(), 6, local_batch, layout);
  EXPECT_EQ(r.losses.size(), 6u) << r.output;
  for (size_t i = 0; i < r.losses.size(); ++i)
    EXPECT_NEAR(r.losses[i], straight_losses()[i], 1e-5 * straight_losses()[i]) << "step " << i + 1;
  return dir.path();
}

void expect_resume_from(const std::string& saved, int nproc, int local_batch, const std::vector<std::string>& layout) {
  test::TempDir dir;
  fs::copy(saved + "/checkpoint", dir / "checkpoint", fs::copy_options::recursive);
  LaunchedRun r = nproc == 1 ? LaunchedRun{} : launch(nproc, dir.path(), 12, local_batch, layout);
  if (nproc == 1) {
    Trainer t(config(dir.path(), 12));
    r.losses = t.train();
  } else {
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
  }
  ASSERT_EQ(r.losses.size(), 6u) << r.output;
  for (size_t i = 0; i < 6; ++i)
    EXPECT_NEAR(r.losses[i], straight_losses()[6 + i], 1e-5 * straight_losses()[6 + i]) << "step " << 7 + i;
}

TEST(CheckpointReshard, Tp2xFsdp2ResumedAsOneProcessAndAsTp4) {
  test::TempDir saved;
  saved_under(4, 6, kTp2, saved);  // TP 2 x FSDP 2: global batch 12 over 2 data-parallel ranks
  expect_resume_from(saved.path(), 1, 12, {});
  expect_resume_from(saved.path(), 4, 12, kTp4);
}

TEST(CheckpointReshard, Tp4ResumedAsTp2xFsdp2AndFsdp2ResumedAsTp2) {
  test::TempDir saved;
  saved_under(4, 12, kTp4, saved);
  expect_resume_from(saved.path(), 4, 6, kTp2);
  expect_resume_from(fsdp2_checkpoint(), 2, 12, kTp2);
}

TEST(CheckpointResume, Fsdp2StoppedAndResumedIsBitwiseTheUninterruptedFsdp2Run) {
  test::TempDir straight, dir;
  LaunchedRun all = launch(2, straight.path(), 12, 6);
  fs::copy(fsdp2_checkpoint() + "/checkpoint", dir / "checkpoint", fs::copy_options::recursive);
  LaunchedRun rest = launch(2, dir.path(), 12, 6);
  ASSERT_EQ(all.losses.size(), 12u);
  ASSERT_EQ(rest.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(rest.losses[i], all.losses[6 + i]) << "step " << 7 + i;
}

TEST(CheckpointResume, Fsdp2LastSaveInHfHoldsTheTrainedWeights) {
  test::TempDir dir;
  LaunchedRun r = launch(2, dir.path(), 3, 6, {"--checkpoint.last_save_model_only", "true", "--checkpoint.last_save_in_hf"},
                         {{"TITAN_DEBUG_DUMP_WEIGHTS", dir / "w.safetensors"}});
  ASSERT_EQ(r.losses.size(), 3u) << r.output;
  auto trained = safetensors::load(dir / "w.safetensors").tensors;
  checkpoint::HFSource hf(dir / "checkpoint/step-3", model_spec("llama3"), "debugmodel");
  for (const auto& [name, w] : trained) {
    if (name == "__losses__") continue;
    at::Tensor got = hf.read("model." + name, std::vector<int64_t>(w.dim(), 0), w.sizes().vec());
    EXPECT_TRUE(at::equal(got, w)) << name;
  }
}

TEST(CheckpointResume, ACorruptFileOfOneRankStopsEveryRankNamingIt) {
  test::TempDir dir;
  fs::copy(fsdp2_checkpoint() + "/checkpoint", dir / "checkpoint", fs::copy_options::recursive);
  const std::string victim = dir / "checkpoint/step-6/rank-00001.safetensors";
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(victim) - 100));
    f.put('\x33');
  }
  std::vector<std::string> argv = {kTitan, "launch", "--nproc-per-node", "2", "--master-port", "0", "--", "train"};
  auto args = base_args(dir.path(), 12);
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), {"--training.local_batch_size", "6"});
  auto r = test::run_process(argv, {{"OMP_NUM_THREADS", "1"}}, std::chrono::seconds(120));
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(victim), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step:  7"), std::string::npos) << r.output;  // nobody trained on
}

// A save killed (SIGKILL) at each moment of the write leaves the previous checkpoint loadable; the
// partial folder is ignored and removed by the next run, which continues like the uninterrupted run.
TEST(CheckpointCrash, KillDuringASaveKeepsThePreviousCheckpoint) {
  for (const std::string phase : {"data", "index", "rename"}) {
    test::TempDir dir;
    fs::copy(fsdp2_checkpoint() + "/checkpoint", dir / "checkpoint", fs::copy_options::recursive);
    // Resume at step 6 and die while saving step 8.
    std::vector<std::string> argv = {kTitan, "launch", "--nproc-per-node", "2", "--master-port", "0", "--", "train"};
    auto args = base_args(dir.path(), 12);
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--training.local_batch_size", "6", "--checkpoint.interval", "8"});
    auto r = test::run_process(argv, {{"TITAN_FAULT_INJECT", "action=kill,point=checkpoint_" + phase + ",step=8,rank=any"},
                                {"OMP_NUM_THREADS", "1"}},
                               std::chrono::seconds(300));
    EXPECT_NE(r.exit_code, 0) << phase << ": " << r.output;
    auto complete = checkpoint::list_checkpoints(dir / "checkpoint");
    ASSERT_EQ(complete.size(), 1u) << phase;
    EXPECT_EQ(complete.begin()->first, 6) << phase;
    EXPECT_TRUE(fs::exists(dir / "checkpoint/step-8.partial")) << phase;
    LaunchedRun again = launch(2, dir.path(), 12, 6);
    EXPECT_NE(again.output.find("that did not complete"), std::string::npos) << again.output;
    EXPECT_FALSE(fs::exists(dir / "checkpoint/step-8.partial")) << phase;
    ASSERT_EQ(again.losses.size(), 6u) << phase << again.output;
    for (size_t i = 0; i < 6; ++i)
      EXPECT_NEAR(again.losses[i], straight_losses()[6 + i], 1e-5 * straight_losses()[6 + i]) << phase;
  }
}


// Resuming reads every block twice (checked on every rank first, then straight into the live tensors),
// so that no second copy of the model and optimizer state is ever held: the peak of CPU memory while a
// checkpoint is loaded stays within one largest tensor of the training peak (staging a copy of the
// whole state would exceed it by the state's size).
TEST(CheckpointResume, ResumingNeedsNoSecondCopyOfTheState) {
  mem::install_cpu_tracking();
  test::TempDir dir;
  Trainer(config(dir.path(), 6)).train();
  mem::reset_cpu_peak();
  const int64_t before = mem::cpu_allocated_bytes();
  Trainer resumed(config(dir.path(), 12));
  const int64_t resume_peak = mem::cpu_peak_bytes() - before;
  ASSERT_EQ(resumed.step(), 6);
  mem::reset_cpu_peak();
  resumed.train();
  const int64_t train_peak = mem::cpu_peak_bytes() - before;  // both counted from before the resumed run
  // The largest tensor of the debug model: the embedding / output, 2048 x 256 fp32.
  const int64_t largest = 2048 * 256 * 4;
  EXPECT_LE(resume_peak, train_peak + largest)
      << "resume peak " << resume_peak << " B, training peak " << train_peak << " B";
}

// A folder that not every rank sees (node-local disks) is refused at start-up, before any training.
TEST(CheckpointResume, ACheckpointFolderNotEveryRankSeesIsRefusedAtStartUp) {
  test::TempDir dir;
  std::vector<std::string> argv = {kTitan, "launch", "--nproc-per-node", "2", "--master-port", "0", "--", "train"};
  auto args = base_args(dir.path(), 6);
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), {"--training.local_batch_size", "6"});
  auto r = test::run_process(argv, {{"OMP_NUM_THREADS", "1"},
                                    {"TITAN_TEST_RANK_CHECKPOINT_FOLDER", "1=" + std::string(dir / "node1")}},
                             std::chrono::seconds(300));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("the checkpoint folder " + dir.path() + "/checkpoint is not shared by every rank: rank 1 "
                          "does not see the file"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("file system that every rank shares"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step:"), std::string::npos) << "trained before refusing: " << r.output;
  EXPECT_TRUE(checkpoint::list_checkpoints(dir / "checkpoint").empty());
}

}  // namespace
}  // namespace titan
