// The trainer end to end: gradient accumulation, determinism, the log line of a real run, and
// torchtitan's own TOML files (both generations) run through the titan binary.
#include "data/data_test_util.h"
#include "test_util.h"

#include "titan/common/folder_lock.h"
#include "titan/config/job_config.h"
#include "titan/trainer/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>

namespace titan {
namespace {

const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";

JobConfig small_config(const test::TempDir& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"--job.config_file", kSource + "/configs/llama3_debugmodel.toml",
                                   "--job.dump_folder", dir.path(),
                                   "--model.hf_assets_path", kSource + "/assets/tokenizer",
                                   "--training.seq_len", "32", "--training.local_batch_size", "8",
                                   "--training.steps", "3", "--metrics.log_freq", "100"};
  args.insert(args.end(), extra.begin(), extra.end());
  return parse_config(args);
}

TEST(Trainer, GradientAccumulationEqualsTheBigBatch) {
  // 2 micro-batches of 4 read the same 8 samples as one batch of 8; the loss of each micro-batch
  // is scaled by the global token count, so gradients and losses agree to fp32 rounding.
  // fp32 compute on a GPU too: the comparison is at fp32's rounding.
  test::TempDir a_dir, b_dir;
  Trainer big(small_config(a_dir, {"--training.mixed_precision_param", "float32"}));
  Trainer accum(small_config(b_dir, {"--training.local_batch_size", "4", "--training.global_batch_size", "8",
                                     "--training.mixed_precision_param", "float32"}));
  ASSERT_EQ(accum.gradient_accumulation_steps(), 2);
  for (int step = 0; step < 3; ++step) {
    StepResult rb = big.train_step(), ra = accum.train_step();
    EXPECT_NEAR(ra.loss, rb.loss, 1e-5 * rb.loss) << "step " << step + 1;
    EXPECT_NEAR(ra.grad_norm, rb.grad_norm, 1e-4 * rb.grad_norm) << "step " << step + 1;
    if (step > 0) continue;
    auto pa = accum.model()->named_parameters(), pb = big.model()->named_parameters();
    for (const auto& p : pb) {
      EXPECT_LT(test::relative_error(pa[p.key()].grad(), p.value().grad()), 1e-5) << p.key();
      EXPECT_TRUE(p.value().grad().abs().sum().item<double>() > 0) << p.key();
    }
  }
}

// A step reads nothing from the device unless it logs (or saves, validates, or is the last): the
// loss, gradient norm and non-finite flag stay device tensors and are read together at log steps.
// Counted as aten::_local_scalar_dense calls (every .item()) over the steps that do not log, with
// gradient clipping on (the debug config's max_norm 1) and gradient accumulation; a callback that
// reads one value in a non-log step is counted, so the counter can see a read.
TEST(Trainer, NoHostReadsOutsideLogSteps) {
  test::TempDir dir;
  ::setenv("TITAN_DEBUG_DUMP_COMM", (dir / "comm").c_str(), 1);
  for (const bool read_in_callback : {false, true}) {
    SCOPED_TRACE(read_in_callback ? "a read in step 3's callback" : "training alone");
    Trainer t(small_config(dir, {"--training.steps", "6", "--metrics.log_freq", "5", "--training.local_batch_size", "4",
                                 "--training.global_batch_size", "8"}));
    if (read_in_callback)
      t.set_step_callback([](int64_t step) {
        if (step == 3) (void)at::ones({1}).sum().item<double>();
      });
    const std::vector<double> losses = t.train();
    ASSERT_EQ(losses.size(), 6u);  // every step's loss, read in batches at steps 1, 5 and 6
    for (double l : losses) EXPECT_TRUE(std::isfinite(l) && l > 0);
    EXPECT_EQ(t.host_reads_outside_log_steps(), read_in_callback ? 1 : 0);
  }
  ::unsetenv("TITAN_DEBUG_DUMP_COMM");
}

TEST(Trainer, DeterministicRunsAreBitwiseRepeatable) {
  test::TempDir a_dir, b_dir;
  ::unsetenv("CUBLAS_WORKSPACE_CONFIG");
  Trainer a(small_config(a_dir, {"--debug.seed", "7", "--debug.deterministic"}));
  // cuBLAS needs a fixed workspace for deterministic matmuls on CUDA (as torchtitan sets it).
  ASSERT_NE(std::getenv("CUBLAS_WORKSPACE_CONFIG"), nullptr);
  EXPECT_STREQ(std::getenv("CUBLAS_WORKSPACE_CONFIG"), ":4096:8");
  Trainer b(small_config(b_dir, {"--debug.seed", "7", "--debug.deterministic"}));
  EXPECT_EQ(a.train(), b.train());
  auto pa = a.model()->named_parameters();
  for (const auto& p : b.model()->named_parameters()) EXPECT_TRUE(at::equal(pa[p.key()], p.value())) << p.key();
}

// The pattern torchtitan users parse their logs with.
const std::regex kLogLine(
    R"(step:\s*(\d+)\s+loss:\s*([\d.]+)\s+grad_norm:\s*([\d.]+)\s+memory:\s*([\d.]+)GiB\(([\d.]+)%\)\s+)"
    R"(tps:\s*([\d,]+)\s+tflops:\s*([\d.]+)\s+mfu:\s*([\d.]+%|N/A))");

std::vector<std::pair<int, double>> parse_losses(const std::string& output) {
  std::vector<std::pair<int, double>> out;
  for (auto it = std::sregex_iterator(output.begin(), output.end(), kLogLine); it != std::sregex_iterator(); ++it)
    out.emplace_back(std::stoi((*it)[1]), std::stod((*it)[2]));
  return out;
}

TEST(TitanTrain, DebugRunLowersTheLossAndLogsLikeTorchtitan) {
  test::TempDir dir;
  auto r = test::run_process({kTitan, "train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml",
                              "--job.dump_folder", dir.path(), "--training.seq_len", "128",
                              "--training.local_batch_size", "4", "--training.steps", "30", "--optimizer.lr", "2e-3",
                              "--lr_scheduler.warmup_steps", "5", "--metrics.log_freq", "5",
                              "--metrics.enable_tensorboard"},
                             test::with_visible_gpus(), std::chrono::seconds(600));  // on the GPU where there is one
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto losses = parse_losses(r.output);
  ASSERT_EQ(losses.size(), 7u) << r.output;  // step 1 and every 5th step
  EXPECT_EQ(losses.front().first, 1);
  EXPECT_EQ(losses.back().first, 30);
  EXPECT_LT(losses.back().second, losses.front().second - 0.5) << r.output;
  // The resolved config and a TensorBoard event file are in the dump folder.
  EXPECT_TRUE(std::filesystem::exists(dir / "config.toml"));
  bool event_file = false;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir / "tb"))
    event_file |= e.path().filename().string().rfind("events.out.tfevents", 0) == 0;
  EXPECT_TRUE(event_file);
}

TEST(TitanTrain, TorchtitanTomlFilesOfBothGenerationsRun) {
  // torchtitan's own files, unchanged; overrides only for paths, sizes, steps and the features
  // titan does not have yet (profiling, activation checkpointing, checkpointing).
  const std::string fixtures = kSource + "/tests/unit/config/fixtures/";
  const std::vector<std::vector<std::string>> runs = {
      {"--job.config_file", fixtures + "seed003_old_debug.toml", "--model.tokenizer_path", kSource + "/assets/tokenizer",
       "--profiling.enable_profiling", "false", "--activation_checkpoint.mode", "none", "--training.batch_size", "2",
       "--training.seq_len", "64", "--training.steps", "2"},
      {"--job.config_file", fixtures + "seed002_new_8b_custom.toml", "--model.flavor", "debugmodel",
       "--model.hf_assets_path", kSource + "/assets/tokenizer", "--training.dataset", "c4_test",
       "--activation_checkpoint.mode", "none", "--checkpoint.enable", "false", "--training.local_batch_size", "2",
       "--training.seq_len", "64", "--training.steps", "2"},
  };
  for (const auto& run : runs) {
    test::TempDir dir;
    std::vector<std::string> argv = {kTitan, "train", "--job.dump_folder", dir.path()};
    argv.insert(argv.end(), run.begin(), run.end());
    auto r = test::run_process(argv, {}, std::chrono::seconds(300));
    EXPECT_EQ(r.exit_code, 0) << run[1] << "\n" << r.output;
    EXPECT_FALSE(parse_losses(r.output).empty()) << r.output;
  }
}

TEST(TitanTrain, UnsupportedFeaturesAndBadInputAreClearErrors) {
  test::TempDir dir;
  auto r = test::run_process({kTitan, "train", "--job.dump_folder", dir.path(), "--compile.enable"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("--compile.enable false"), std::string::npos) << r.output;
  r = test::run_process({kTitan, "train", "--activation_checkpoint.mode", "none", "--training.stepz", "3"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("training.steps"), std::string::npos) << r.output;
  r = test::run_process({kTitan, "train", "--activation_checkpoint.mode", "none", "--job.dump_folder", dir.path(),
                         "--model.hf_assets_path", dir / "nothing-here"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("nothing-here"), std::string::npos) << r.output;
}

// One run per dump folder: while a process holds the folder's lock, `titan train` into it is refused
// at start-up naming the holder (this process), before it writes anything (a second lock in the
// holding process shares it). Released, the lock file left behind is no obstacle: the next run
// trains; and a run killed with SIGKILL while holding it leaves no stale lock.
TEST(TitanTrain, ADumpFolderInUseIsRefusedAndALeftoverLockIsNot) {
  test::TempDir dir;
  const std::vector<std::string> train = {kTitan, "train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml",
                                          "--job.dump_folder", dir.path(), "--training.steps", "1",
                                          "--training.seq_len", "32"};
  {
    FolderLock held(dir.path(), "job.dump_folder");
    const std::string holder = "process " + std::to_string(::getpid());
    auto r = test::run_process(train);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.output.find("job.dump_folder " + dir.path() + " is in use by another run (host "), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find(holder + ")"), std::string::npos) << r.output;
    EXPECT_FALSE(std::filesystem::exists(dir / "config.toml")) << "the refused run wrote into the folder";
    FolderLock shared(dir.path(), "job.dump_folder");  // this process's lock, shared
  }
  ASSERT_TRUE(std::filesystem::exists(dir / ".titan.lock"));
  auto r = test::run_process(train);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(std::filesystem::exists(dir / "config.toml"));
  // A run killed with SIGKILL while it holds the lock (it has written its process into the lock
  // file) leaves no stale lock: the next run trains.
  std::string command = "set -u; ";
  for (const std::string& a : train) command += "'" + a + "' ";
  command += "--training.steps 100000 >/dev/null 2>&1 & pid=$!; for i in $(seq 600); do "
             "grep -q \"process $pid\" '" + (dir / ".titan.lock") + "' && break; sleep 0.1; done; "
             "kill -9 $pid; wait $pid; echo killed=$?; ";
  for (const std::string& a : train) command += "'" + a + "' ";
  command += "&& echo second-run-trained";
  r = test::run_process({"bash", "-c", command}, {}, std::chrono::seconds(300));
  EXPECT_NE(r.output.find("killed=137"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("second-run-trained"), std::string::npos) << r.output;
}

TEST(TitanTrain, NoConfigFileTrainsWithTorchtitansDefaults) {
  // torchtitan's defaults (debugmodel, c4_test, selective activation checkpointing of 1 block in 2),
  // one step of the default batch (8 x 2048 tokens).
  test::TempDir dir;
  auto r = test::run_process({kTitan, "train", "--job.dump_folder", dir.path(), "--training.steps", "1"}, {},
                             std::chrono::seconds(600));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("Activation checkpointing: 1 block in 2"), std::string::npos) << r.output;
  EXPECT_EQ(parse_losses(r.output).size(), 1u) << r.output;
}

TEST(TitanTokenize, ShardsTrainLikeTheText) {
  // `titan tokenize` writes the bundled corpus as shards (tokenizer found beside the binary, run from
  // another folder); training on them gives the losses of training on the text.
  test::TempDir dir;
  auto t = test::run_process({"bash", "-c", "cd " + dir.path() + " && " + kTitan +
                                                " tokenize --output shards --training.dataset titan_corpus"});
  ASSERT_EQ(t.exit_code, 0) << t.output;
  EXPECT_NE(t.output.find("tokenized 3294 documents"), std::string::npos) << t.output;
  std::vector<std::string> common = {"--job.config_file", kSource + "/configs/llama3_debugmodel.toml",
                                     "--training.dataset", "titan_corpus", "--training.seq_len", "64",
                                     "--training.local_batch_size", "2", "--training.steps", "3"};
  std::vector<std::string> text = {kTitan, "train", "--job.dump_folder", dir / "text"};
  std::vector<std::string> shards = {kTitan, "train", "--job.dump_folder", dir / "shards-run",
                                     "--training.dataset_path", dir / "shards"};
  text.insert(text.end(), common.begin(), common.end());
  shards.insert(shards.end(), common.begin(), common.end());
  auto a = test::run_process(text), b = test::run_process(shards);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("shards from"), std::string::npos) << b.output;
  auto la = parse_losses(a.output), lb = parse_losses(b.output);
  ASSERT_EQ(la.size(), 3u);
  EXPECT_EQ(la, lb);
}

// `titan tokenize` on every core: 1, 2 and 4 threads write byte-identical folders; 3 processes under
// `titan launch` (each a part of the files) write the same token stream, one manifest at the end.
TEST(TitanTokenize, ThreadsAndProcessesWriteTheSameStream) {
  test::TempDir dir;
  std::filesystem::create_directories(dir / "text");
  for (int f = 0; f < 5; ++f) {
    std::vector<std::string> docs;
    for (int d = 0; d < 300; ++d) {
      std::string doc;
      for (int w = 0; w < 20 + (d * 13 + f) % 90; ++w) doc += "word" + std::to_string((w * 31 + d * 7 + f) % 97) + " ";
      docs.push_back(doc);
    }
    test::write_file(dir / ("text/part" + std::to_string(f) + ".jsonl"), test::jsonl(docs));
  }
  auto tokenize = [&](const std::vector<std::string>& launcher, const std::string& out, const std::string& workers) {
    std::vector<std::string> argv = launcher;
    argv.insert(argv.end(), {"tokenize", "--output", dir / out, "--workers", workers, "--training.dataset", "c4",
                             "--training.dataset_path", dir / "text", "--model.hf_assets_path",
                             kSource + "/assets/tokenizer"});
    auto r = test::run_process(argv);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return r;
  };
  auto files_of = [&](const std::string& out) {
    std::map<std::string, std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(dir / out)) {
      std::ifstream in(e.path(), std::ios::binary);
      files[e.path().filename().string()] = std::string(std::istreambuf_iterator<char>(in), {});
    }
    return files;
  };
  auto r = tokenize({kTitan}, "t1", "1");
  EXPECT_NE(r.output.find("tokenized 1500 documents"), std::string::npos) << r.output;
  tokenize({kTitan}, "t2", "2");
  tokenize({kTitan}, "t4", "4");
  const auto one = files_of("t1");
  ASSERT_EQ(one.count("manifest.json"), 1u);
  EXPECT_EQ(files_of("t2"), one);
  EXPECT_EQ(files_of("t4"), one);
  // Three processes: shards part-NNNNN-shard-NNNNN.bin, whose tokens in manifest order are the stream.
  r = tokenize({kTitan, "launch", "--nproc-per-node", "3", "--master-port", "0", "--"}, "p3", "1");
  EXPECT_NE(r.output.find("(3 process(es) of 1 thread(s)"), std::string::npos) << r.output;
  auto tokens_of = [&](const std::string& out) {
    std::ifstream in(dir / (out + "/manifest.json"));
    const auto m = nlohmann::json::parse(in);
    std::string tokens;
    for (const auto& s : m.at("shards")) {
      std::ifstream f(dir / (out + "/" + s.at("file").get<std::string>()), std::ios::binary);
      const std::string bytes(std::istreambuf_iterator<char>(f), {});
      tokens += bytes.substr(64, 4 * s.at("num_tokens").get<size_t>());
    }
    return std::make_pair(m, tokens);
  };
  const auto [m1, s1] = tokens_of("t1");
  const auto [m3, s3] = tokens_of("p3");
  EXPECT_EQ(m3.at("shards").size(), 3u);
  EXPECT_EQ(m3.at("num_tokens"), m1.at("num_tokens"));
  EXPECT_EQ(m3.at("num_documents"), m1.at("num_documents"));
  EXPECT_EQ(m3.at("sources"), m1.at("sources"));
  EXPECT_TRUE(s3 == s1) << "the three processes' stream differs from one process's";
  for (const auto& [name, bytes] : files_of("p3")) EXPECT_EQ(name.find(".json.tmp"), std::string::npos) << name;
  EXPECT_EQ(files_of("p3").count("part-00001.json"), 0u);  // the parts' summaries are gone
}

TEST(TitanCli, VersionNamesTheCommitAndTheBuild) {
  auto r = test::run_process({kTitan, "--version"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto git = test::run_process({"git", "-C", kSource, "rev-parse", "--short=12", "HEAD"});
  ASSERT_EQ(git.exit_code, 0) << git.output;
  const std::string commit = git.output.substr(0, git.output.find('\n'));
  EXPECT_EQ(r.output.rfind("titan 0.1.0 (commit " + commit, 0), 0u) << r.output << " vs " << commit;
  EXPECT_NE(r.output.find("LibTorch 2.11.0, "), std::string::npos) << r.output;
  EXPECT_TRUE(r.output.find("CUDA build with NCCL") != std::string::npos ||
              r.output.find("CPU-only build") != std::string::npos) << r.output;
}

// Cheap mistakes are reported before the model is built: with the 8B flavor (whose build alone takes
// far longer and 32 GB), a missing dataset path or initial load path fails at once.
TEST(TitanTrain, CheapMistakesAreReportedBeforeTheModelIsBuilt) {
  test::TempDir dir;
  const std::vector<std::string> base = {kTitan, "train", "--job.config_file", kSource + "/configs/llama3_8b.toml",
                                         "--job.dump_folder", dir.path(), "--training.steps", "1"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = base;
    argv.insert(argv.end(), extra.begin(), extra.end());
    return test::run_process(argv, {}, std::chrono::seconds(60));
  };
  auto r = with({"--training.dataset", "c4"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("dataset 'c4' has no default location"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0) << r.output;
  r = with({"--training.dataset_path", dir / "nowhere.jsonl"});
  EXPECT_NE(r.output.find("does not exist: set training.dataset_path"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0) << r.output;
  r = with({"--training.dataset", "titan_corpus", "--checkpoint.initial_load_path", dir / "no-checkpoint"});
  EXPECT_NE(r.output.find("checkpoint.initial_load_path '" + (dir / "no-checkpoint") + "' does not exist"),
            std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0) << r.output;
  EXPECT_EQ(r.output.find("building, initializing and sharding"), std::string::npos) << r.output;
  // A checkpoint folder that cannot be created (a file stands in its path).
  test::write_file(dir / "a-file", "x");
  r = with({"--training.dataset", "titan_corpus", "--checkpoint.folder", dir / "a-file/checkpoints", "--checkpoint.enable"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("cannot create the folder " + (dir / "a-file/checkpoints") + " (checkpoint.folder)"),
            std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10.0) << r.output;
  EXPECT_EQ(r.output.find("building, initializing and sharding"), std::string::npos) << r.output;
}

// Resuming: a step folder that is not a complete checkpoint is logged when skipped; a seq_len change
// is refused naming the exclusion that resumes anyway, which then works.
TEST(TitanTrain, ResumeSaysWhatItSkipsAndHowToChangeSeqLen) {
  test::TempDir dir;
  auto run = [&](const std::string& seq_len, std::vector<std::string> extra) {
    std::vector<std::string> argv = {kTitan, "train", "--job.config_file", kSource + "/configs/llama3_debugmodel.toml",
                                     "--job.dump_folder", dir.path(), "--training.seq_len", seq_len,
                                     "--checkpoint.enable", "--checkpoint.interval", "1"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return test::run_process(argv);
  };
  auto first = run("32", {"--training.steps", "1"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  std::filesystem::create_directories(dir / "checkpoint/step-7");  // no index.json
  auto changed = run("64", {"--training.steps", "2"});
  EXPECT_EQ(changed.exit_code, 1) << changed.output;
  EXPECT_NE(changed.output.find("Checkpoint: skipping " + (dir / "checkpoint/step-7") +
                                ": no index.json, so not a complete titan checkpoint"), std::string::npos)
      << changed.output;
  EXPECT_NE(changed.output.find("resume with the same seq_len, or keep the model and optimizer and start the data "
                                "stream afresh with --checkpoint.exclude_from_loading dataloader"), std::string::npos)
      << changed.output;
  auto excluded = run("64", {"--training.steps", "2", "--checkpoint.exclude_from_loading", "dataloader"});
  EXPECT_EQ(excluded.exit_code, 0) << excluded.output;
  EXPECT_EQ(parse_losses(excluded.output).front().first, 2) << excluded.output;
}

// The pre-flight memory check: the 8B flavor with a local batch of 256 sequences of 8192 tokens (fp32
// on the CPU: terabytes for one rank, beyond any machine) stops before the tokenizer or the model,
// with both figures; skipped on request.
TEST(TitanTrain, ARunThatCannotFitStopsBeforeTheModelIsBuilt) {
  test::TempDir dir;
  const std::vector<std::string> argv = {kTitan, "train", "--job.config_file", kSource + "/configs/llama3_8b.toml",
                                         "--job.dump_folder", dir.path(), "--training.dataset", "titan_corpus",
                                         "--training.steps", "1", "--training.local_batch_size", "256"};
  auto r = test::run_process(argv, test::with_visible_gpus(), std::chrono::seconds(120));  // the GPU's memory where there is one
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_LT(r.seconds, 30.0) << r.output;
  const std::regex figures("this run does not fit in memory: `titan estimate` predicts a peak of (\\d+\\.\\d) GiB per "
                           "rank \\(single process, activation checkpointing .*\\), and (\\d+\\.\\d) GiB is available to each "
                           "rank");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, figures)) << r.output;
  EXPECT_GT(std::stod(m[1]), 2000.0);
  EXPECT_LT(std::stod(m[2]), std::stod(m[1]));
  EXPECT_NE(r.output.find("--debug.skip_memory_check goes on anyway"), std::string::npos) << r.output;
  // Skipped: the run goes on to the next step of start-up (here the 8B tokenizer, which is absent).
  std::vector<std::string> skip = argv;
  skip.insert(skip.end(), {"--debug.skip_memory_check", "--model.hf_assets_path", dir / "no-tokenizer"});
  r = test::run_process(skip, {}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_EQ(r.output.find("does not fit in memory"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("no-tokenizer"), std::string::npos) << r.output;
}

// Out of memory during a run (an address-space limit, which the debug model's batch of 64
// sequences of 2048 tokens exceeds and one sequence does not): titan's message, naming the step, what
// did not fit and what to change, and exit code 1, not an allocator abort; the same during start-up.
TEST(TitanTrain, OutOfMemoryDuringTheRunEndsWithTitansMessage) {
  // The run sees no GPU (test::run_process), so the limit bounds its CPU tensors on a GPU machine too;
  // CudaTraining.OutOfMemoryInAStepEndsTheRunWithALoadableSnapshot runs the CUDA case.
  // The address space titan maps before it trains depends on the LibTorch it loads (a CUDA build's
  // libraries and driver take about 1 GB more than a CPU build's): the limit is the smallest of 4, 5,
  // ... 8 GB under which one sequence trains, plus 0.5 GB (what a process maps varies from run to
  // run: allocator arenas, thread stacks); 64 sequences need several GB more.
  test::TempDir dir;
  long limit_kb = 4000000;
  auto run = [&](const std::string& batch) {
    const std::string cmd = "ulimit -v " + std::to_string(limit_kb) + " && exec " + kTitan +
                            " train --job.config_file " + kSource +
                            "/configs/llama3_debugmodel.toml --job.dump_folder " + dir.path() +
                            " --training.steps 1 --training.seq_len 2048 --training.local_batch_size " + batch +
                            " --checkpoint.enable=false --debug.skip_memory_check";
    return test::run_process({"bash", "-c", cmd}, {}, std::chrono::seconds(300));
  };
  auto fits = run("1");
  while (fits.exit_code != 0 && limit_kb < 8000000) {
    limit_kb += 1000000;
    fits = run("1");
  }
  ASSERT_EQ(fits.exit_code, 0) << "ulimit -v " << limit_kb << "\n" << fits.output;
  limit_kb += 500000;
  auto r = run("64");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex("titan train: error: out of memory at step 1: a CPU tensor of "
                                                     "[0-9.]+ [MG]iB during [a-z]+ did not fit, with [0-9.]+ [MG]iB of CPU "
                                                     "tensors already allocated")))
      << r.output;
  EXPECT_NE(r.output.find("to fit: activation_checkpoint.mode = \"full\" (now \"selective\"), a smaller "
                          "training.local_batch_size"),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("the pre-flight memory check was skipped (debug.skip_memory_check)"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("enforce fail"), std::string::npos) << r.output;
  // The training step fits and the validation's batch does not: the advice is the validation's.
  r = run("1 --validation.enable --validation.dataset c4_test --validation.freq 1 --validation.steps 1 "
          "--validation.seq_len 2048 --validation.local_batch_size 64");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("titan train: error: out of memory in the validation after step 1: a CPU tensor of "),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("to fit: a smaller validation.local_batch_size (now 64) or validation.seq_len (now 2048), "
                          "or validation.enable = false"),
            std::string::npos) << r.output;
  // The 1B flavor's parameters alone exceed the limit: the model does not fit during start-up.
  r = run("1 --model.flavor 1B --training.seq_len 128");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("titan train: error: out of memory during start-up (building, initializing or loading the "
                          "model): a CPU tensor of "),
            std::string::npos) << r.output;
  EXPECT_NE(r.output.find("to fit: shard the model over more ranks (FSDP, TP, PP), offload it to CPU memory "
                          "(training.enable_cpu_offload) or choose a smaller model.flavor"),
            std::string::npos) << r.output;
}

// What the out-of-memory error suggests changing follows the activation checkpointing in use: full
// checkpointing where it is not, a lower budget under memory_budget, neither when it is full already.
TEST(Trainer, OutOfMemoryAdviceFollowsTheCheckpointingMode) {
  test::TempDir dir;
  auto advice = [&](const std::vector<std::string>& ac) {
    const JobConfig cfg = small_config(dir, ac);
    try {
      TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate 2.00 GiB");
    } catch (const c10::OutOfMemoryError& e) {
      return out_of_memory_message(cfg, "at step 3", e, OutOfMemoryAt::Step);
    }
    return std::string();
  };
  const std::string budget = advice({"--activation_checkpoint.mode", "memory_budget",
                                     "--activation_checkpoint.memory_budget", "0.35"});
  EXPECT_NE(budget.find("to fit: a lower activation_checkpoint.memory_budget (now 0.35; 0 recomputes every block), "
                        "a smaller training.local_batch_size"),
            std::string::npos) << budget;
  const std::string none = advice({"--activation_checkpoint.mode", "none"});
  EXPECT_NE(none.find("to fit: activation_checkpoint.mode = \"full\" (now \"none\"), a smaller"), std::string::npos)
      << none;
  const std::string full = advice({"--activation_checkpoint.mode", "full"});
  EXPECT_NE(full.find("to fit: a smaller training.local_batch_size"), std::string::npos) << full;
  EXPECT_EQ(full.find("activation_checkpoint"), std::string::npos) << full;
}

// scripts/download_hf_assets.py without the Hub (offline here): a clear error that says what to do, and
// the shipped configs name the command that fetches their tokenizer.
TEST(Assets, TheDownloadScriptSaysWhatToDoOfflineAndTheConfigsNameIt) {
  test::TempDir dir;
  auto r = test::run_process({test::python(), kSource + "/scripts/download_hf_assets.py", "--repo_id",
                              "meta-llama/Llama-3.1-8B", "--local_dir", dir.path()},
                             {{"HF_HUB_OFFLINE", "1"}}, std::chrono::seconds(120));
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("download_hf_assets: error: cannot reach the Hugging Face Hub"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(dir / "Llama-3.1-8B"), std::string::npos) << r.output;
  r = test::run_process({test::python(), kSource + "/scripts/download_hf_assets.py", "--repo_id", "llama"});
  EXPECT_NE(r.output.find("is not an organisation/name Hub repository"), std::string::npos) << r.output;
  for (const auto& e : std::filesystem::directory_iterator(kSource + "/configs")) {
    std::ifstream in(e.path());
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    const size_t at = text.find("hf_assets_path = \"./assets/hf/");
    if (at == std::string::npos) continue;
    const std::string name = text.substr(at + 30, text.find('"', at + 30) - at - 30);
    EXPECT_NE(text.find("scripts/download_hf_assets.py --repo_id "), std::string::npos) << e.path();
    EXPECT_NE(text.find("/" + name + " "), std::string::npos) << e.path() << ": the command does not fetch " << name;
  }
}

TEST(TitanEstimate, ReadsTheSeeds8BFile) {
  auto r = test::run_process({kTitan, "estimate", "--job.config_file",
                              kSource + "/tests/unit/config/fixtures/seed002_new_8b_custom.toml"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("model: llama3 8B"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("parameters: 8,030,261,248"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("seq_len 8192"), std::string::npos) << r.output;
}


// `titan config`: the resolved config as TOML (older keys mapped, command line over the file), which
// reads back to the same config; what titan train would refuse is refused with the same words.
TEST(TitanCli, ConfigPrintsTheResolvedConfig) {
  const std::string older = kSource + "/tests/unit/config/fixtures/torchtitan_2024_2025_keys.toml";
  auto r = test::run_process({kTitan, "config", "--world-size", "4", "--job.config_file", older, "--training.steps", "7"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const size_t start = r.output.find("# Resolved titan config");
  ASSERT_NE(start, std::string::npos) << r.output;
  JobConfig printed = parse_config_text(r.output.substr(start), "printed");
  JobConfig expected = parse_config({"--job.config_file", older, "--training.steps", "7"});
  EXPECT_EQ(printed.training.steps, 7);
  EXPECT_EQ(printed.profiling.profile_freq, 50);  // [profiling] profile_every_x_iter
  printed.job.config_file = expected.job.config_file = "";
  EXPECT_TRUE(printed == expected) << r.output;
  // Refused as titan train refuses it.
  r = test::run_process({kTitan, "config", "--compile.enable"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("titan config: error: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("compile.enable"), std::string::npos) << r.output;
  // The layout over --world-size ranks, and the batch it splits, as titan train checks them.
  r = test::run_process({kTitan, "config", "--world-size", "8", "--parallelism.tensor_parallel_degree", "3"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("world size 8 is not divisible"), std::string::npos) << r.output;
  r = test::run_process({kTitan, "config", "--world-size", "4", "--training.local_batch_size", "8",
                         "--training.global_batch_size", "48"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("training.global_batch_size 48 is not a multiple of local_batch_size 8 x data-parallel "
                          "degree 4"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(test::run_process({kTitan, "config", "--world-size", "4", "--training.global_batch_size", "64"}).exit_code,
            0);
  r = test::run_process({kTitan, "config", "--world-size", "4x"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("--world-size takes a positive number of ranks, not '4x'"), std::string::npos) << r.output;
  r = test::run_process({kTitan, "config", "--help", "profiling"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--profiling.profile_freq"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace titan
