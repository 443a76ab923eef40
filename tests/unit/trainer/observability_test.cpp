// Observability of a training run: profiler traces ([profiling] enable_profiling), memory snapshots
// (enable_memory_snapshot), validation ([validation]) and the metrics file that `titan report` reads.
//
// Traces are checked as what a user opens: Chrome trace JSON per rank, holding the named ranges
// (forward, backward, optimizer, data loading, each FSDP unit's all-gather and reduce-scatter, the
// collectives by mesh dimension) next to the CPU operators. Validation is checked against a loss
// computed directly from the model's logits with ATen's cross-entropy on the same tokens, and across
// layouts (FSDP 2, TP 2 and DDP 2 against one process).
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/common/trace.h"
#include "titan/components/data/dataloader.h"
#include "titan/components/metrics/profiler.h"
#include "titan/config/job_config.h"
#include "titan/trainer/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

namespace titan {
namespace {

namespace fs = std::filesystem;
const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";

std::vector<std::string> train_args(const std::string& dump, int steps, std::vector<std::string> extra = {}) {
  std::vector<std::string> a = {
      "--job.config_file", kSource + "/configs/llama3_debugmodel.toml", "--job.dump_folder", dump,
      "--model.hf_assets_path", kSource + "/assets/tokenizer", "--training.seq_len", "32",
      "--training.global_batch_size", "8", "--training.steps", std::to_string(steps),
      "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--checkpoint.enable", "false"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

test::ProcessResult launch(int nproc, const std::vector<std::string>& args, std::map<std::string, std::string> env = {}) {
  std::vector<std::string> argv = {kTitan};
  if (nproc > 1) argv.insert(argv.end(), {"launch", "--nproc-per-node", std::to_string(nproc), "--master-port", "0", "--"});
  argv.push_back("train");
  argv.insert(argv.end(), args.begin(), args.end());
  env["OMP_NUM_THREADS"] = "1";
  return test::run_process(argv, env, std::chrono::seconds(300));
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  EXPECT_TRUE(f.good()) << path;
  return nlohmann::json::parse(f);
}

// The records of kind `kind` in a run's metrics file, by step.
std::map<int64_t, nlohmann::json> records(const std::string& dump, const std::string& kind) {
  std::map<int64_t, nlohmann::json> out;
  std::ifstream f(dump + "/metrics.jsonl");
  EXPECT_TRUE(f.good()) << dump;
  for (std::string line; std::getline(f, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.at("kind") == kind) out[j.at("step").get<int64_t>()] = j;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Profiler traces

metrics::ProfilerOptions trace_options(const std::string& dir, int64_t freq, int64_t warmup, int64_t active) {
  metrics::ProfilerOptions o;
  o.traces = true;
  o.traces_dir = dir;
  o.freq = freq;
  o.warmup = warmup;
  o.active = active;
  return o;
}

TEST(Profiling, ScheduleFollowsTorchProfilersCycle) {
  test::TempDir dir;
  metrics::ProfilerOptions o = trace_options(dir / "traces", 10, 3, 1);
  metrics::Profiler p(o);
  // schedule(wait=6, warmup=3, active=1) stepped once per training step: step 10 recorded, 7-9 warm up.
  for (int64_t s = 1; s <= 20; ++s) {
    EXPECT_EQ(p.records(s), s == 10 || s == 20) << s;
    EXPECT_EQ(p.warms_up(s), (s >= 7 && s <= 9) || (s >= 17 && s <= 19)) << s;
  }
  EXPECT_EQ(p.trace_path(10), dir / "traces/iteration_10/rank0_trace.json");

  o.freq = 5;
  o.warmup = 0;
  o.active = 2;
  metrics::Profiler q(o);
  for (int64_t s = 1; s <= 10; ++s) EXPECT_EQ(q.records(s), s % 5 == 4 || s % 5 == 0) << s;

  o.freq = 3;
  o.warmup = 3;
  o.active = 1;
  try {
    metrics::Profiler bad(o);
    FAIL() << "profile_freq below warmup + active accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("profiling.profile_freq (3) must be at least profiler_warmup + profiler_active"),
              std::string::npos)
        << e.what();
  }
}

// In one process: the recorded steps' operators and ranges are in the trace of their cycle, the other
// steps' are in none, and a run that ends inside a recorded window still writes it.
TEST(Profiling, RecordsTheChosenStepsOnly) {
  test::TempDir dir;
  // Steps 2-3 and 5-6 recorded, 1 and 4 warm up.
  const metrics::ProfilerOptions o = trace_options(dir / "traces", 3, 1, 2);
  {
    metrics::Profiler p(o);
    for (int64_t s = 1; s <= 5; ++s) {
      p.step_begin(s);
      {
        TraceRange range("work_of_step_", s);
        at::mm(at::ones({8, 8}), at::ones({8, 8}));
      }
      p.step_end(s);
    }
    EXPECT_TRUE(fs::exists(p.trace_path(3)));
    EXPECT_FALSE(fs::exists(p.trace_path(5)));
    p.finish(5);  // the run ended inside the window of steps 5-6
  }
  std::vector<std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir / "traces"))
    if (e.is_regular_file()) files.push_back(fs::relative(e.path(), dir / "traces").string());
  std::sort(files.begin(), files.end());
  EXPECT_EQ(files, (std::vector<std::string>{"iteration_3/rank0_trace.json", "iteration_5/rank0_trace.json"}));

  auto names = [&](const std::string& file) {
    std::set<std::string> out;
    const nlohmann::json trace = read_json(dir / ("traces/" + file));
    for (const auto& e : trace.at("traceEvents"))
      if (e.contains("name")) out.insert(e.at("name").get<std::string>());
    return out;
  };
  const auto first = names("iteration_3/rank0_trace.json"), second = names("iteration_5/rank0_trace.json");
  for (const char* n : {"work_of_step_2", "work_of_step_3", "ProfilerStep#2", "ProfilerStep#3", "aten::mm"})
    EXPECT_TRUE(first.count(n)) << n;
  for (const char* n : {"work_of_step_1", "work_of_step_4", "work_of_step_5"}) EXPECT_FALSE(first.count(n)) << n;
  EXPECT_TRUE(second.count("work_of_step_5"));
  EXPECT_FALSE(second.count("work_of_step_4"));
}

// A 3-step run of 2 processes (FSDP) with profile_freq 3: one Chrome trace per rank for step 3, with
// the training's named ranges, each FSDP unit's collectives and the collectives by mesh dimension;
// memory snapshots (CPU: the peak breakdown) per rank at the same step.
TEST(Profiling, TraceOfAThreeStepRunPerRank) {
  test::TempDir dir;
  auto r = launch(2, train_args(dir.path(), 3,
                                {"--training.local_batch_size", "4", "--profiling.enable_profiling", "true",
                                 "--profiling.save_traces_folder", "profile_trace", "--profiling.profile_freq", "3",
                                 "--profiling.profiler_warmup", "1", "--profiling.enable_memory_snapshot", "true"}));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("[rank 0]: " ), std::string::npos);
  EXPECT_NE(r.output.find("Dumping profiler traces at step 3"), std::string::npos) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE("rank " + std::to_string(rank));
    const std::string path = dir / ("profile_trace/iteration_3/rank" + std::to_string(rank) + "_trace.json");
    ASSERT_TRUE(fs::exists(path)) << r.output;
    const nlohmann::json trace = read_json(path);
    ASSERT_TRUE(trace.at("traceEvents").is_array());
    std::set<std::string> ranges;
    int64_t cpu_ops = 0;
    for (const auto& e : trace.at("traceEvents")) {
      const std::string cat = e.value("cat", "");
      if (cat == "cpu_op") ++cpu_ops;
      if (cat != "user_annotation") continue;
      // Complete events with a start and a duration: what Perfetto and chrome://tracing draw.
      EXPECT_EQ(e.at("ph"), "X");
      EXPECT_TRUE(e.at("ts").is_number() && e.at("dur").is_number());
      ranges.insert(e.at("name").get<std::string>());
    }
    EXPECT_GT(cpu_ops, 100);
    for (const char* name : {"ProfilerStep#3", "data_loading", "forward", "backward", "optimizer",
                             "FSDP::all_gather (root)", "FSDP::all_gather (layers.0)", "FSDP::all_gather_wait (layers.0)",
                             "FSDP::reduce_scatter (layers.0)", "FSDP::reduce_scatter_wait (layers.0)",
                             "FSDP::reduce_scatter (root)", "c10d::all_gather [dp_shard_cp]",
                             "c10d::reduce_scatter [dp_shard_cp]", "c10d::all_reduce [dp]",
                             "c10d::wait all_gather [dp_shard_cp]"})
      EXPECT_TRUE(ranges.count(name)) << name;
    EXPECT_FALSE(ranges.count("ProfilerStep#2"));  // step 2 warmed up, step 1 waited
    const std::string snapshot = dir / ("memory_snapshot/iteration_3/rank" + std::to_string(rank) + "_cpu_memory.txt");
    std::ifstream f(snapshot);
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("CPU tensor memory at the peak"), std::string::npos) << snapshot << "\n" << text;
    EXPECT_TRUE(fs::exists(dir / ("memory_snapshot/iteration_3/rank" + std::to_string(rank) + "_cpu_memory.json")));
  }
  EXPECT_FALSE(fs::exists(dir / "profile_trace/iteration_2"));
}

// An out-of-memory error in a step (injected: the CUDA allocator's error type) ends the run with an
// error naming the step and the snapshot written at the failure, iteration_<step>_exit.
TEST(Profiling, OutOfMemoryWritesTheSnapshotAndNamesIt) {
  test::TempDir dir;
  auto r = launch(1, train_args(dir.path(), 4, {"--profiling.enable_memory_snapshot", "true"}),
                  {{"TITAN_FAULT_INJECT", "action=oom,point=forward,step=3"}});
  EXPECT_NE(r.exit_code, 0);
  // The CPU's peak breakdown (the run sees no GPU; CudaTraining.OutOfMemoryInAStepEndsTheRunWithALoadableSnapshot
  // covers the CUDA allocator's snapshot).
  const std::string snapshot = dir / "memory_snapshot/iteration_3_exit/rank0_cpu_memory.txt";
  EXPECT_NE(r.output.find("titan train: error: out of memory at step 3: CUDA out of memory"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("memory snapshot: " + snapshot), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(snapshot));
  // Without snapshots the error says how to get one.
  test::TempDir plain;
  r = launch(1, train_args(plain.path(), 4), {{"TITAN_FAULT_INJECT", "action=oom,point=backward,step=2"}});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("out of memory at step 2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("set profiling.enable_memory_snapshot = true"), std::string::npos) << r.output;
}

// ---------------------------------------------------------------------------------------------
// Validation

std::vector<std::string> validation_args(const std::string& local_batch = "2") {
  return {"--validation.enable", "true", "--validation.dataset", "c4_test", "--validation.freq", "2",
          "--validation.steps", "2", "--validation.local_batch_size", local_batch, "--validation.seq_len", "48"};
}

// The loss validate() reports equals the mean cross-entropy (ATen's, on the full logits) of the model
// over the same tokens; it is the same every time (same batches), needs no gradient and changes
// nothing: training with validation on gives the losses and weights of training without it.
TEST(Validation, LossEqualsTheReferenceOnTheSameTokens) {
  test::TempDir dir;
  auto a = train_args(dir.path(), 3, validation_args());
  // fp32 compute on a GPU too (the reference below runs the model without autocast).
  a.insert(a.end(), {"--training.local_batch_size", "8", "--metrics.enable_tensorboard", "true",
                     "--training.mixed_precision_param", "float32"});
  Trainer t(parse_config(a));
  ASSERT_TRUE(t.validation_enabled());
  const metrics::ValidationStats v = t.validate();
  EXPECT_EQ(v.tokens, 2 * 2 * 48);

  data::DataConfig dc;
  dc.dataset = "c4_test";
  dc.local_batch_size = 2;
  dc.seq_len = 48;
  auto tokenizer = load_tokenizer(kSource + "/assets/tokenizer");
  auto loader = data::make_dataloader(dc, *tokenizer);
  double sum = 0;
  int64_t n = 0;
  {
    at::NoGradGuard no_grad;
    for (int b = 0; b < 2; ++b) {
      data::Batch batch = loader->next();
      at::Tensor logits = t.model()->forward(batch.inputs.to(t.device())).to(at::kDouble);
      sum += at::cross_entropy_loss(logits.flatten(0, 1), batch.labels.to(t.device()).flatten(), {}, at::Reduction::Sum)
                 .item<double>();
      n += batch.labels.numel();
    }
  }
  EXPECT_NEAR(v.loss, sum / static_cast<double>(n), 1e-6 * v.loss);
  EXPECT_EQ(t.validate().loss, v.loss);  // the same batches every time
  for (const auto& p : t.parameters()) EXPECT_FALSE(p.local.grad().defined()) << p.name;

  // Training is not changed by validation.
  const auto with = t.train();
  test::TempDir plain_dir;
  auto b = train_args(plain_dir.path(), 3, {"--training.local_batch_size", "8", "--training.mixed_precision_param", "float32"});
  Trainer plain(parse_config(b));
  const auto without = plain.train();
  EXPECT_EQ(with, without);
  const auto wa = t.full_parameters(), wb = plain.full_parameters();
  for (const auto& [name, w] : wa) EXPECT_TRUE(at::equal(w, wb.at(name))) << name;

  // Logged at step 1 and every freq steps, with its perplexity, in the log format and the metrics file.
  const auto logged = records(dir.path(), "validation");
  ASSERT_EQ(logged.size(), 2u);  // steps 1 and 2 (freq 2, 3 steps)
  EXPECT_TRUE(logged.count(1) && logged.count(2));
  for (const auto& [step, j] : logged) {
    const double loss = j.at("loss").get<double>();
    EXPECT_NEAR(j.at("perplexity").get<double>(), std::exp(loss), 1e-9 * std::exp(loss)) << step;
  }
  EXPECT_LT(logged.at(2).at("loss").get<double>(), logged.at(1).at("loss").get<double>());
  // And to TensorBoard, under torchtitan's tags (the event file holds them as plain strings).
  std::string events;
  for (const auto& e : fs::recursive_directory_iterator(dir / "tb"))
    if (e.is_regular_file()) {
      std::ifstream f(e.path(), std::ios::binary);
      events += std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    }
  for (const char* tag : {"validation_metrics/loss", "validation_metrics/perplexity", "validation_metrics/throughput(tps)",
                          "validation_metrics/memory/max_reserved(GiB)"})
    EXPECT_NE(events.find(tag), std::string::npos) << tag;
}

// The validation loss is a property of the model and the data, not of the layout: with the same
// global validation batch (local_batch_size x data-parallel ranks), FSDP 2, TP 2 and DDP 2 log the
// one-process figures (1e-5 relative, as the training losses) at every evaluation.
TEST(Validation, EqualAcrossLayouts) {
  auto run = [](int nproc, std::vector<std::string> layout) {
    test::TempDir dir;
    auto extra = validation_args(layout.back());
    layout.pop_back();
    extra.insert(extra.end(), layout.begin(), layout.end());
    auto r = launch(nproc, train_args(dir.path(), 2, extra));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("validate step:  2  loss: "), std::string::npos) << r.output;
    std::map<int64_t, double> out;
    for (const auto& [step, j] : records(dir.path(), "validation")) out[step] = j.at("loss").get<double>();
    return out;
  };
  // The last entry of each layout: validation.local_batch_size.
  const auto one = run(1, {"--training.local_batch_size", "8", "4"});
  ASSERT_EQ(one.size(), 2u);
  for (const auto& [name, layout] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"FSDP 2", {"--training.local_batch_size", "4", "2"}},
           {"TP 2", {"--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2", "4"}},
           {"DDP 2", {"--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2", "2"}}}) {
    SCOPED_TRACE(name);
    const auto got = run(2, layout);
    ASSERT_EQ(got.size(), one.size());
    for (const auto& [step, loss] : one) EXPECT_NEAR(got.at(step), loss, 1e-5 * loss) << "step " << step;
  }
}

// validation.steps = -1 evaluates one pass over the set: every batch that starts in the first pass,
// and no more (the loop ends; the stream is global, so every rank stops at the same batch).
TEST(Validation, WholeSetIsOnePass) {
  test::TempDir dir;
  {
    std::ofstream f(dir / "held_out.jsonl");
    for (int i = 0; i < 12; ++i)
      f << "{\"text\": \"Held-out document number " << i << ": the quick brown fox jumps over the lazy dog, again and "
        << "again, while the validation loop counts its batches.\"}\n";
  }
  auto a = train_args(dir.path(), 1,
                      {"--training.local_batch_size", "8", "--validation.enable", "true", "--validation.dataset_path",
                       dir / "held_out.jsonl", "--validation.steps", "-1", "--validation.local_batch_size", "2",
                       "--validation.seq_len", "32"});
  Trainer t(parse_config(a));
  const metrics::ValidationStats v = t.validate();
  ASSERT_GT(v.tokens, 0);
  ASSERT_EQ(v.tokens % 64, 0);
  const int64_t batches = v.tokens / 64;
  EXPECT_GT(batches, 1);
  data::DataConfig dc;
  dc.dataset = "c4_test";
  dc.dataset_path = dir / "held_out.jsonl";
  dc.local_batch_size = 2;
  dc.seq_len = 32;
  auto tokenizer = load_tokenizer(kSource + "/assets/tokenizer");
  auto loader = data::make_dataloader(dc, *tokenizer);
  for (int64_t b = 0; b < batches; ++b) {
    EXPECT_EQ(loader->epoch(), 0) << "batch " << b << " starts after the first pass";
    loader->next();
  }
  EXPECT_GT(loader->epoch(), 0) << "one more batch would still be in the first pass";
  EXPECT_EQ(t.validate().tokens, v.tokens);
}

TEST(Validation, BadSettingsAreClearErrors) {
  test::TempDir dir;
  auto a = train_args(dir.path(), 1, {"--validation.enable", "true", "--validation.dataset", "c4_validation"});
  try {
    Trainer t(parse_config(a));
    FAIL() << "c4_validation without a path accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("validation data: dataset 'c4_validation' has no default location"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("set validation.dataset_path"), std::string::npos) << e.what();
  }
  a = train_args(dir.path(), 1, {"--validation.enable", "true", "--validation.dataset_path", dir / "absent.jsonl"});
  EXPECT_THROW(Trainer(parse_config(a)), UserError);
  a = train_args(dir.path(), 1, {"--validation.enable", "true", "--validation.steps", "0"});
  EXPECT_THROW(parse_config(a), UserError);
}

}  // namespace
}  // namespace titan
