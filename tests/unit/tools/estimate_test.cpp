// `titan estimate` against what runs measure.
//
// Memory: each named run trains 3 steps on the CPU (log_freq 1) and its largest `memory:` figure of
// the log line (peak bytes of CPU tensors, memory_tracker.h) is compared with the estimate's
// predicted peak for the same config with --device cpu. Tolerance 10% (the dry run reproduces the
// allocations of the run's own code; what it cannot see, such as a CPU kernel's scratch buffers and
// the data loader's, measured well under 2% in these runs). The debug model trains through the real
// binaries (titan train, titan launch); a wider and a deeper Llama, registered in this test binary
// as model "llama3_shapes", train through the trainer in worker processes of this binary.
//
// Communication: workers run the trainer's step over Gloo and print what the mesh counted; the
// estimate's bytes and calls per mesh dimension and operation must be equal.
//
// Pipeline and context parallelism (EstimateMatchesEveryRank): every rank's trainer runs in a worker
// of this binary; each rank's measured peak and counted bytes are compared with the estimate's for
// its pipeline rank.
#include "distributed/launched_training.h"
#include "models/tiny_llama.h"
#include "test_util.h"

#include "titan/common/error.h"
#include "titan/common/memory_tracker.h"
#include "titan/common/tensor_storage.h"
#include "titan/components/optimizer/optimizer.h"
#include "titan/distributed/ddp.h"
#include "titan/distributed/data_parallel.h"
#include "titan/distributed/mesh.h"
#include "titan/distributed/placement.h"
#include "titan/distributed/tensor_parallel.h"
#include "titan/nn/loss.h"
#include "titan/models/llama3/model.h"
#include "titan/models/common/decoder_parallelize.h"
#include "titan/models/registry.h"
#include "titan/tools/estimate.h"
#include "titan/trainer/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdlib>
#include <algorithm>
#include <fstream>
#include <mutex>
#include <regex>
#include <set>
#include <sstream>

#include <unistd.h>

namespace titan {
namespace {

using namespace std::chrono_literals;

const std::string kSource = TITAN_SOURCE_DIR;
const std::string kTitan = std::string(TITAN_BINARY_DIR) + "/titan";
const std::string kDebugConfig = kSource + "/configs/llama3_debugmodel.toml";

// ---------------------------------------------------------------------------------------------
// Model "llama3_shapes": Llama 3 blocks of other shapes than the shipped flavors.
//   wide: dim 512, 4 layers, 8 heads over 2 KV heads (grouped-query attention), hidden 1536
//   deep: dim 128, 16 layers, 4 heads (multi-head attention), hidden 512
//   tiny: the unit tests' shape (tiny_llama.h), 2 layers, vocabulary 130 (not divisible by 4 ranks)
llama3::ModelArgs shapes_flavor(const std::string& name) {
  llama3::ModelArgs a;
  a.vocab_size = 2048;
  a.multiple_of = 256;
  a.ffn_dim_multiplier.reset();
  if (name == "wide") {
    a.dim = 512, a.n_layers = 4, a.n_heads = 8, a.n_kv_heads = 2;
  } else if (name == "deep") {
    a.dim = 128, a.n_layers = 16, a.n_heads = 4, a.n_kv_heads = 4;
  } else if (name == "tiny") {
    a = test::tiny_llama(2, 130, 0);
  } else {
    throw UserError("llama3_shapes has no flavor '" + name + "'");
  }
  return a;
}

void register_shapes_model() {
  static std::once_flag once;
  std::call_once(once, [] {
    ModelSpec spec = model_spec("llama3");
    spec.name = "llama3_shapes";
    spec.flavors = {"wide", "deep", "tiny"};
    spec.build = [](const std::string& flavor, const at::TensorOptions& opts, int64_t max_seq_len) -> LanguageModel {
      llama3::ModelArgs a = shapes_flavor(flavor);
      a.max_seq_len = max_seq_len;
      return std::make_shared<llama3::TransformerImpl>(a, opts);
    };
    spec.hf_adapter = nullptr;
    register_model(std::move(spec));
  });
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(line);
  return out;
}

std::string join_lines(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + "\n";
  return s;
}

// Worker: the trainer, as `titan train` runs it, with the rank's launch environment set from the
// test's variables (the test process hosts the rendezvous store). TITAN_TEST_ARGS: one argument per line.
TITAN_TEST_WORKER_FN(estimate_train) {
  register_shapes_model();
  const std::string rank = std::getenv("TITAN_TEST_RANK"), world = std::getenv("TITAN_TEST_WORLD");
  if (world != "1") {
    for (const char* name : {"RANK", "LOCAL_RANK"}) setenv(name, rank.c_str(), 1);
    for (const char* name : {"WORLD_SIZE", "LOCAL_WORLD_SIZE"}) setenv(name, world.c_str(), 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::getenv("TITAN_TEST_PORT"), 1);
    setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  }
  return run_training(parse_config(split_lines(std::getenv("TITAN_TEST_ARGS"))));
}

// ---------------------------------------------------------------------------------------------
// Measured peaks.

// The largest `memory:` figure of the log lines, in bytes. The percentage (of the machine's physical
// memory, 2 decimals) resolves finer than the GiB figure (2 decimals of a GiB); both must agree.
int64_t measured_peak(const std::string& log) {
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  const std::regex field(R"(step:\s*\d+\s.*memory:\s*([\d.]+)GiB\(([\d.]+)%\))");
  double peak = -1;
  int steps = 0;
  for (auto it = std::sregex_iterator(log.begin(), log.end(), field); it != std::sregex_iterator(); ++it) {
    const double gib = std::stod((*it)[1]), bytes = std::stod((*it)[2]) / 100 * physical;
    EXPECT_NEAR(bytes / (1 << 30), gib, 0.006 + 0.0001 * physical / (1 << 30)) << (*it)[0];
    peak = std::max(peak, bytes);
    ++steps;
  }
  EXPECT_EQ(steps, 3) << log;
  return static_cast<int64_t>(peak);
}

struct MemoryRun {
  std::string name;
  std::string model, flavor;  // llama3 debugmodel: the real binaries; llama3_shapes: workers of this binary
  int nproc;
  int64_t seq_len, local_batch;
  std::string ac;  // none | full | selective k | selective op
  int replicate = 1;  // data_parallel_replicate_degree: DDP (replicas only) or HSDP
  int tp = 1;         // tensor_parallel_degree (with sequence and loss parallel)
  std::vector<std::string> extra = {};  // more options (expert parallelism)
};

void PrintTo(const MemoryRun& r, std::ostream* os) { *os << r.name; }

// "mode [selective_ac_option]" as command-line options.
std::vector<std::string> ac_args(const std::string& spec) {
  std::istringstream in(spec);
  std::string mode, every;
  in >> mode >> every;
  std::vector<std::string> a = {"--activation_checkpoint.mode", mode};
  if (!every.empty())  // "memory_budget B" or "selective K"
    a.insert(a.end(), {mode == "memory_budget" ? "--activation_checkpoint.memory_budget"
                                               : "--activation_checkpoint.selective_ac_option",
                       every});
  return a;
}

std::vector<std::string> config_args(const MemoryRun& r) {
  std::vector<std::string> a = {"--job.config_file", kDebugConfig, "--model.name", r.model, "--model.flavor", r.flavor,
                                "--training.seq_len", std::to_string(r.seq_len), "--training.local_batch_size",
                                std::to_string(r.local_batch), "--training.global_batch_size",
                                std::to_string(r.local_batch * r.nproc / r.tp), "--training.steps", "3",
                                "--metrics.log_freq", "1", "--metrics.disable_color_printing",
                                "--parallelism.data_parallel_replicate_degree", std::to_string(r.replicate),
                                "--parallelism.tensor_parallel_degree", std::to_string(r.tp)};
  const auto ac = ac_args(r.ac);
  a.insert(a.end(), ac.begin(), ac.end());
  a.insert(a.end(), r.extra.begin(), r.extra.end());
  return a;
}

// Trains the run and returns rank 0's output.
std::string train(const MemoryRun& r, const test::TempDir& dir) {
  std::vector<std::string> args = config_args(r);
  args.insert(args.end(), {"--job.dump_folder", dir.path()});
  if (r.model != "llama3_shapes") {
    std::vector<std::string> argv = {kTitan};
    if (r.nproc > 1) argv = {kTitan, "launch", "--nproc-per-node", std::to_string(r.nproc), "--master-port", "0", "--"};
    argv.push_back("train");
    argv.insert(argv.end(), args.begin(), args.end());
    auto p = test::run_process(argv, {{"OMP_NUM_THREADS", "1"}}, 600s);
    EXPECT_EQ(p.exit_code, 0) << p.output;
    return p.output;
  }
  auto store = dist::make_tcp_store("127.0.0.1", 0, true, 60s);
  auto results = test::run_workers("estimate_train", r.nproc,
                                   {{"TITAN_TEST_ARGS", join_lines(args)}, {"TITAN_TEST_WORLD", std::to_string(r.nproc)},
                                    {"TITAN_TEST_PORT", std::to_string(dist::store_port(store))},
                                    {"OMP_NUM_THREADS", "1"}},
                                   600s);
  for (const auto& w : results) EXPECT_EQ(w.exit_code, 0) << w.output;
  return results[0].output;
}

class EstimateMatchesMeasuredPeak : public ::testing::TestWithParam<MemoryRun> {};

TEST_P(EstimateMatchesMeasuredPeak, WithinTenPercent) {
  register_shapes_model();
  const MemoryRun& r = GetParam();
  test::TempDir dir;
  const int64_t measured = measured_peak(train(r, dir));
  EstimateOptions opts;
  opts.world_size = r.nproc;
  opts.device = "cpu";
  const Estimate e = estimate(parse_config(config_args(r)), opts);
  const double ratio = static_cast<double>(e.peak_device) / static_cast<double>(measured);
  std::printf("%s: measured %.1f MiB, estimated %.1f MiB (%+.1f%%)\n", r.name.c_str(), measured / 1048576.0,
              e.peak_device / 1048576.0, 100 * (ratio - 1));
  EXPECT_NEAR(ratio, 1.0, 0.10) << "measured " << measured << " bytes, estimated " << e.peak_device << "\n"
                                << format_estimate(e);
}

const std::string kMoeFlavor = test::qwen3_moe_config().dump();

// clang-format off
INSTANTIATE_TEST_SUITE_P(Runs, EstimateMatchesMeasuredPeak, ::testing::Values(
    //        name                           model            flavor        nproc seq  batch  AC
    MemoryRun{"Debug1Seq256NoAC",            "llama3",        "debugmodel", 1,    256, 4,     "none"},
    MemoryRun{"Debug1Seq256Full",            "llama3",        "debugmodel", 1,    256, 4,     "full"},
    MemoryRun{"Debug1Seq1024NoAC",           "llama3",        "debugmodel", 1,   1024, 4,     "none"},
    MemoryRun{"Debug1Seq1024Selective2",     "llama3",        "debugmodel", 1,   1024, 4,     "selective 2"},
    MemoryRun{"Debug1Seq1024Budget04",       "llama3",        "debugmodel", 1,   1024, 4,     "memory_budget 0.4"},
    MemoryRun{"DebugFsdp2Seq512NoAC",        "llama3",        "debugmodel", 2,    512, 4,     "none"},
    MemoryRun{"DebugFsdp2Seq512Full",        "llama3",        "debugmodel", 2,    512, 4,     "full"},
    MemoryRun{"DebugFsdp2Seq1024Selective2", "llama3",        "debugmodel", 2,   1024, 2,     "selective 2"},
    MemoryRun{"Wide1Seq512NoAC",             "llama3_shapes", "wide",       1,    512, 2,     "none"},
    MemoryRun{"WideFsdp2Seq512Selective2",   "llama3_shapes", "wide",       2,    512, 2,     "selective 2"},
    MemoryRun{"Deep1Seq1024Full",            "llama3_shapes", "deep",       1,   1024, 4,     "full"},
    MemoryRun{"DeepFsdp2Seq256NoAC",         "llama3_shapes", "deep",       2,    256, 8,     "none"},
    MemoryRun{"Debug1Seq512PerOperator",     "llama3",        "debugmodel", 1,    512, 4,     "selective op"},
    MemoryRun{"DebugDdp2Seq512NoAC",         "llama3",        "debugmodel", 2,    512, 4,     "none",        2},
    MemoryRun{"DebugHsdp2x2Seq512Full",      "llama3",        "debugmodel", 4,    512, 4,     "full",        2},
    MemoryRun{"DebugTp2Seq512NoAC",          "llama3",        "debugmodel", 2,    512, 4,     "none",        1, 2},
    MemoryRun{"DebugTp2Fsdp2Seq512Full",     "llama3",        "debugmodel", 4,    512, 4,     "full",        1, 2},
    // A small Qwen3-MoE (a dense first layer, then MoE layers of 8 experts, top-2): the routed copies,
    // the grouped experts' activations and, under expert parallelism, the dispatch buffers of the
    // all-to-alls (the estimate takes the routing as balanced; a random router is close to it).
    MemoryRun{"Moe1Seq512NoAC",              "qwen3",         kMoeFlavor,   1,    512, 4,     "none"},
    MemoryRun{"MoeEp2Seq512NoAC",            "qwen3",         kMoeFlavor,   2,    512, 4,     "none",        1, 1,
              {"--parallelism.expert_parallel_degree", "2"}},
    MemoryRun{"MoeEp2Seq512Full",            "qwen3",         kMoeFlavor,   2,    512, 4,     "full",        1, 1,
              {"--parallelism.expert_parallel_degree", "2"}}),
    [](const ::testing::TestParamInfo<MemoryRun>& info) { return info.param.name; });
// clang-format on

// ---------------------------------------------------------------------------------------------
// Pipeline and context parallelism: every rank's peak and bytes.
//
// Each run trains the debug model in worker processes of this binary, each the trainer of one rank
// (as `titan train` under `titan launch`): three steps one by one, each rank's peak of CPU tensor
// bytes read per step (the figure its log line would print), then a fourth through
// Trainer::train(), which writes what the mesh counted over the four steps (TITAN_DEBUG_DUMP_COMM).
// The estimate with --device cpu must give every pipeline rank's peak within 10% of the largest
// measured on its ranks (FSDP's first shard holds the padding), the worst rank's within 10% of the
// largest of all, and every rank's bytes and calls per mesh dimension and operation exactly.

struct RankedRun {
  std::string name;
  int nproc;
  int64_t seq_len, local_batch;
  std::string ac;
  int pp = 1;
  std::string schedule = "1F1B";
  int cp = 1;
  std::string rotate = "allgather";
  int tp = 1;
};

void PrintTo(const RankedRun& r, std::ostream* os) { *os << r.name; }

constexpr int kMeasuredSteps = 3, kRunSteps = 4;

std::vector<std::string> ranked_args(const RankedRun& r) {
  const int dp = r.nproc / (r.pp * r.cp * r.tp);
  std::vector<std::string> a = {"--job.config_file", kDebugConfig, "--training.seq_len", std::to_string(r.seq_len),
                                "--training.local_batch_size", std::to_string(r.local_batch),
                                "--training.global_batch_size", std::to_string(r.local_batch * dp), "--training.steps",
                                std::to_string(kRunSteps), "--metrics.log_freq", "1", "--metrics.disable_color_printing",
                                "--parallelism.pipeline_parallel_degree", std::to_string(r.pp),
                                "--parallelism.pipeline_parallel_schedule", r.schedule,
                                "--parallelism.context_parallel_degree", std::to_string(r.cp),
                                "--parallelism.context_parallel_rotate_method", r.rotate,
                                "--parallelism.tensor_parallel_degree", std::to_string(r.tp)};
  const auto ac = ac_args(r.ac);
  a.insert(a.end(), ac.begin(), ac.end());
  return a;
}

// Worker: one rank's trainer; prints "PEAK <bytes>" (the largest of the measured steps' peaks).
TITAN_TEST_WORKER_FN(estimate_train_ranked) {
  const std::string rank = std::getenv("TITAN_TEST_RANK"), world = std::getenv("TITAN_TEST_WORLD");
  for (const char* name : {"RANK", "LOCAL_RANK"}) setenv(name, rank.c_str(), 1);
  for (const char* name : {"WORLD_SIZE", "LOCAL_WORLD_SIZE"}) setenv(name, world.c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::getenv("TITAN_TEST_PORT"), 1);
  setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  Trainer trainer(parse_config(split_lines(std::getenv("TITAN_TEST_ARGS"))));
  int64_t peak = 0;
  for (int step = 0; step < kMeasuredSteps; ++step) {
    mem::reset_cpu_peak();
    trainer.train_step();
    peak = std::max(peak, mem::cpu_peak_bytes());
  }
  trainer.train();  // the last step, and the dump of what the mesh counted
  std::printf("PEAK %lld\n", static_cast<long long>(peak));
  return 0;
}

class EstimateMatchesEveryRank : public ::testing::TestWithParam<RankedRun> {};

TEST_P(EstimateMatchesEveryRank, PeaksWithinTenPercentAndBytesExactly) {
  const RankedRun& r = GetParam();
  test::TempDir dir;
  std::vector<std::string> args = ranked_args(r);
  args.insert(args.end(), {"--job.dump_folder", dir.path()});
  auto store = dist::make_tcp_store("127.0.0.1", 0, true, 60s);
  const auto workers = test::run_workers(
      "estimate_train_ranked", r.nproc,
      {{"TITAN_TEST_ARGS", join_lines(args)}, {"TITAN_TEST_WORLD", std::to_string(r.nproc)},
       {"TITAN_TEST_PORT", std::to_string(dist::store_port(store))}, {"TITAN_DEBUG_DUMP_COMM", dir / "comm"},
       {"TITAN_P2P_ORDER_MATCHED", "1"}, {"OMP_NUM_THREADS", "1"}},
      600s);
  std::vector<int64_t> measured;
  for (const auto& w : workers) {
    ASSERT_EQ(w.exit_code, 0) << w.output;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(w.output, m, std::regex(R"(PEAK (\d+))"))) << w.output;
    measured.push_back(std::stoll(m[1]));
  }

  EstimateOptions opts;
  opts.world_size = r.nproc;
  opts.device = "cpu";
  const Estimate e = estimate(parse_config(ranked_args(r)), opts);
  const int per_pp_rank = r.nproc / r.pp;  // pp is the outermost mesh dimension
  ASSERT_EQ(e.pipeline_ranks.size(), r.pp > 1 ? static_cast<size_t>(r.pp) : 0u);
  auto expect_near = [&](int64_t estimated, int64_t got, const std::string& what) {
    const double ratio = static_cast<double>(estimated) / static_cast<double>(got);
    std::printf("%s %s: measured %.1f MiB, estimated %.1f MiB (%+.1f%%)\n", r.name.c_str(), what.c_str(),
                got / 1048576.0, estimated / 1048576.0, 100 * (ratio - 1));
    EXPECT_NEAR(ratio, 1.0, 0.10) << what << ": measured " << got << " bytes, estimated " << estimated << "\n"
                                  << format_estimate(e);
  };
  for (size_t pr = 0; pr < e.pipeline_ranks.size(); ++pr) {
    const int64_t most = *std::max_element(measured.begin() + pr * per_pp_rank, measured.begin() + (pr + 1) * per_pp_rank);
    expect_near(e.pipeline_ranks[pr].peak, most, "pipeline rank " + std::to_string(pr));
  }
  expect_near(e.peak_device, *std::max_element(measured.begin(), measured.end()), "worst rank");

  for (int g = 0; g < r.nproc; ++g) {
    std::ifstream f(dir / ("comm.rank" + std::to_string(g) + ".json"));
    const nlohmann::json j = nlohmann::json::parse(f);
    ASSERT_EQ(j.at("steps").get<int>(), kRunSteps);
    const Estimate::PipelineRank* pr = r.pp > 1 ? &e.pipeline_ranks.at(g / per_pp_rank) : nullptr;
    auto over_the_run = [](const dist::CommBytes& per_step) {
      dist::CommBytes all;
      for (const auto& [group, ops] : per_step)
        for (const auto& [op, v] : ops) all[group][op] = v * kRunSteps;
      return all;
    };
    const dist::CommBytes bytes = over_the_run(pr ? pr->comm_bytes : e.comm_bytes);
    const dist::CommBytes calls = over_the_run(pr ? pr->comm_calls : e.comm_calls);
    EXPECT_EQ(j.at("bytes").get<dist::CommBytes>(), bytes) << "rank " << g << "\n" << format_estimate(e);
    EXPECT_EQ(j.at("calls").get<dist::CommBytes>(), calls) << "rank " << g;
  }
}

// clang-format off
INSTANTIATE_TEST_SUITE_P(Runs, EstimateMatchesEveryRank, ::testing::Values(
    //        name                              nproc seq  batch AC      pp  schedule            cp  rotate
    RankedRun{"Pp2Fsdp2OneFOneBSeq512NoAC",     4,    512, 4,    "none", 2},
    RankedRun{"Pp2Interleaved1F1BSeq512NoAC",   2,    512, 4,    "none", 2,  "Interleaved1F1B"},
    RankedRun{"Pp2GPipeSeq512Selective2",       2,    512, 4,    "selective 2", 2, "GPipe"},
    RankedRun{"Pp2ZBVZeroBubbleSeq512Full",     2,    512, 4,    "full", 2,  "ZBVZeroBubble"},
    RankedRun{"Cp2Seq1024NoAC",                 2,   1024, 2,    "none", 1,  "1F1B",             2},
    RankedRun{"Cp2Fsdp2Seq1024NoACAlltoall",    4,   1024, 2,    "none", 1,  "1F1B",             2,  "alltoall"},
    RankedRun{"Pp2Cp2Seq1024Full",              4,   1024, 2,    "full", 2,  "1F1B",             2}),
    [](const ::testing::TestParamInfo<RankedRun>& info) { return info.param.name; });
// clang-format on

// ---------------------------------------------------------------------------------------------
// Communication: the trainer's step (Trainer::train_step: forward, loss, backward, FSDP/DDP
// reductions, gradient clipping, the loss all-reduces) over Gloo, counted by the real mesh.

constexpr int64_t kCommSeq = 16, kCommBatch = 2;

TITAN_TEST_WORKER_FN(estimate_comm) {
  register_shapes_model();
  const int rank = std::atoi(std::getenv("TITAN_TEST_RANK")), world = std::atoi(std::getenv("TITAN_TEST_WORLD"));
  const int replicate = std::atoi(std::getenv("TITAN_TEST_REPLICATE")), accum = std::atoi(std::getenv("TITAN_TEST_ACCUM"));
  const int tp = std::atoi(std::getenv("TITAN_TEST_TP"));
  at::set_num_threads(1);
  auto store = dist::make_tcp_store("127.0.0.1", static_cast<uint16_t>(std::atoi(std::getenv("TITAN_TEST_PORT"))), false, 60s);
  dist::ParallelDims dims(replicate, -1, 1, tp, 1, world);
  dist::Mesh mesh(dims, rank, store, dist::BackendKind::Gloo, 60s);
  const ModelSpec& spec = model_spec("llama3_shapes");
  LanguageModel model;
  {
    DeferAllocation defer;
    model = spec.build("tiny", at::TensorOptions(), kCommSeq);
  }
  std::unique_ptr<dist::TensorParallel> tensor_par;
  if (tp > 1) tensor_par = std::make_unique<dist::TensorParallel>(mesh["tp"], dist::TensorParallelOptions{});
  dist::DataParallel dp(mesh["dp_shard_cp"], mesh["dp_replicate"], {},
                        [&](const std::string& name, at::Tensor out, const std::vector<int64_t>& begin) {
                          model->init_region(1, name, out, begin);
                        },
                        mesh.device());
  ParallelizeContext ctx;
  ctx.data_parallel = &dp;
  ctx.tensor_parallel = tensor_par.get();
  ctx.ac_mode = "full";  // recomputation communicates nothing more (but TP's collectives inside blocks)
  const ParallelizedModel parallelized = spec.parallelize(*model, ctx);
  const std::vector<dist::PlacedTensor>& params = dp.parameters();
  Optimizer optimizer(dp.named_parameters(), {});
  const double global_tokens = static_cast<double>(accum * kCommBatch * kCommSeq * dims.dp_size());
  const int64_t vocab = model->vocab_size();
  for (int step = 0; step < 2; ++step) {  // the second step is counted, as the estimate counts it
    mesh.reset_bytes();
    optimizer.zero_grad();
    at::Tensor loss_sum = at::zeros({});
    for (int micro = 0; micro < accum; ++micro) {
      at::Tensor tokens = at::randint(vocab, {kCommBatch, kCommSeq + 1}, at::kLong);
      at::Tensor logits = model->forward(tokens.slice(1, 0, kCommSeq));
      at::Tensor loss = parallelized.loss_sum(logits.flatten(0, 1), tokens.slice(1, 1).flatten(0, 1)) / global_tokens;
      logits.reset();
      dp.before_backward(micro == accum - 1);
      loss.backward();
      dp.after_backward(micro == accum - 1);
      loss_sum += loss.detach();
    }
    optimizer.step(std::nullopt, dist::grad_norm_and_clip_divisor(params, 1.0, mesh).second);
    at::Tensor local_max = loss_sum.clone();
    mesh["dp"].all_reduce(loss_sum).wait();
    mesh["dp"].all_reduce(local_max, c10d::ReduceOp::MAX).wait();
  }
  for (const auto& [group, ops] : mesh.bytes())
    for (const auto& [op, bytes] : ops)
      std::printf("COMM %s %s %lld %lld\n", group.c_str(), op.c_str(), static_cast<long long>(bytes),
                  static_cast<long long>(mesh.calls().at(group).at(op)));
  return 0;
}

void expect_communication_as_counted(int world, int replicate, int accum, int tp = 1) {
  register_shapes_model();
  auto store = dist::make_tcp_store("127.0.0.1", 0, true, 60s);
  auto results = test::run_workers("estimate_comm", world,
                                   {{"TITAN_TEST_PORT", std::to_string(dist::store_port(store))},
                                    {"TITAN_TEST_WORLD", std::to_string(world)},
                                    {"TITAN_TEST_REPLICATE", std::to_string(replicate)},
                                    {"TITAN_TEST_ACCUM", std::to_string(accum)}, {"TITAN_TEST_TP", std::to_string(tp)},
                                    {"OMP_NUM_THREADS", "1"}},
                                   300s);
  for (const auto& r : results) ASSERT_EQ(r.exit_code, 0) << r.output;
  dist::CommBytes bytes, calls;
  std::istringstream out(results[0].output);
  for (std::string line; std::getline(out, line);) {
    std::istringstream f(line);
    std::string tag, group, op;
    long long b = 0, c = 0;
    if (f >> tag >> group >> op >> b >> c && tag == "COMM") bytes[group][op] = b, calls[group][op] = c;
  }
  ASSERT_FALSE(bytes.empty()) << results[0].output;

  const JobConfig cfg = parse_config(
      {"--model.name", "llama3_shapes", "--model.flavor", "tiny", "--training.seq_len", std::to_string(kCommSeq),
       "--training.local_batch_size", std::to_string(kCommBatch), "--training.global_batch_size",
       std::to_string(kCommBatch * accum * world / tp), "--parallelism.data_parallel_replicate_degree",
       std::to_string(replicate), "--parallelism.tensor_parallel_degree", std::to_string(tp),
       "--activation_checkpoint.mode", "full"});
  EstimateOptions opts;
  opts.world_size = world;
  opts.device = "cpu";
  const Estimate e = estimate(cfg, opts);
  EXPECT_EQ(e.comm_bytes, bytes) << format_estimate(e) << results[0].output;
  EXPECT_EQ(e.comm_calls, calls) << format_estimate(e) << results[0].output;
}

TEST(EstimateCommunication, Fsdp2IsWhatTheMeshCounts) { expect_communication_as_counted(2, 1, 1); }

// docs/memory.md's table of the shipped configs: each "(config)" row's peak is what `titan estimate`
// prints for that config on that many ranks, so the docs cannot drift from the estimator.
TEST(DocsFigures, TheMemoryTablesConfigRowsAreTheEstimatorsFigures) {
  std::ifstream in(kSource + "/docs/memory.md");
  const std::regex row(R"(^\| (\d+B) \(config[^|]*\| ([^|]+)\|.*\| ([0-9.]+) GiB \| (fits) [^|]*\|$)");
  int rows = 0;
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (!std::regex_match(line, m, row)) continue;
    ++rows;
    int64_t world = 1;
    const std::string ranks = m[2];
    static const std::regex number(R"(\d+)");
    for (auto it = std::sregex_iterator(ranks.begin(), ranks.end(), number); it != std::sregex_iterator(); ++it)
      world *= std::stoll(it->str());
    const std::string size = m[1];
    std::string lower = size;
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    auto r = test::run_process({kTitan, "estimate", "--job.config_file", kSource + "/configs/llama3_" + lower + ".toml",
                                "--world-size", std::to_string(world), "--device", "cuda", "--device-memory-gib", "80"},
                               {}, std::chrono::seconds(120));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("verdict: " + m[4].str() + ": peak " + m[3].str() + " GiB of 80.00 GiB"), std::string::npos)
        << "docs/memory.md: " << line << "\n" << r.output;
  }
  EXPECT_EQ(rows, 3) << "the 8B, 70B and 405B config rows";
}
TEST(EstimateCommunication, Fsdp4WithGradientAccumulationIsWhatTheMeshCounts) { expect_communication_as_counted(4, 1, 2); }
TEST(EstimateCommunication, Hsdp2x2IsWhatTheMeshCounts) { expect_communication_as_counted(4, 2, 1); }
TEST(EstimateCommunication, Ddp2WithGradientAccumulationIsWhatTheMeshCounts) { expect_communication_as_counted(2, 2, 2); }
TEST(EstimateCommunication, Tp2IsWhatTheMeshCounts) { expect_communication_as_counted(2, 1, 1, 2); }
TEST(EstimateCommunication, Tp2xFsdp2WithGradientAccumulationIsWhatTheMeshCounts) {
  expect_communication_as_counted(4, 1, 2, 2);
}

// ---------------------------------------------------------------------------------------------
// The held state, FLOPs, the verdict and the CLI.

JobConfig config(const std::vector<std::string>& args) { return parse_config(args); }

Estimate estimate_of(const std::vector<std::string>& args, int64_t world, const std::string& device = "cuda",
                     double gib = 80) {
  EstimateOptions o;
  o.world_size = world;
  o.device = device;
  o.device_memory_gib = gib;
  return estimate(config(args), o);
}

// Per rank: each parameter's torch.chunk shard of ceil(R / N) rows, fp32; AdamW's two moments like
// the shards and one fp32 step each; FSDP's gradient shards fp32.
TEST(Estimate, ParametersGradientsAndOptimizerStateAreThisLayoutsShards) {
  register_shapes_model();
  for (const auto& [model, flavor, world] : std::vector<std::tuple<std::string, std::string, int>>{
           {"llama3_shapes", "tiny", 3}, {"llama3", "8B", 8}, {"llama3", "debugmodel", 1}}) {
    LanguageModel m = model_spec(model).build(flavor, at::TensorOptions().device(at::kMeta), 64);
    int64_t shard_bytes = 0, count = 0;
    for (const auto& p : m->named_parameters()) {
      const int64_t rows = p.value().size(0), row = p.value().numel() / rows;
      shard_bytes += (rows + world - 1) / world * row * 4;
      ++count;
    }
    const Estimate e = estimate_of({"--model.name", model, "--model.flavor", flavor, "--training.seq_len", "64",
                                    "--training.local_batch_size", "1"},
                                   world);
    EXPECT_EQ(e.params, shard_bytes) << flavor;
    EXPECT_EQ(e.grads, shard_bytes) << flavor;
    EXPECT_EQ(e.optimizer, 2 * shard_bytes + 4 * count) << flavor;
    EXPECT_EQ(e.layout, world > 1 ? "FSDP" : "single process");
  }
}

TEST(Estimate, FlopsPerStepAreFlopsPerTokenTimesTheRanksTokens) {
  // 4 ranks, global batch 32 of local batch 2: 4 micro-batches per step.
  const Estimate e = estimate_of({"--model.flavor", "debugmodel", "--training.seq_len", "512",
                                  "--training.local_batch_size", "2", "--training.global_batch_size", "32"},
                                 4);
  EXPECT_EQ(e.grad_accum_steps, 4);
  EXPECT_EQ(e.tokens_per_step, 4 * 2 * 512);
  EXPECT_DOUBLE_EQ(e.flops_per_step, estimate_model("llama3", "debugmodel", 512).flops_per_token * 4 * 2 * 512);
}

// Llama 3 405B on 128 ranks (FSDP over all of them; titan has no tensor parallelism yet): the dry
// run holds no weights, so it takes seconds and almost no memory.
TEST(Estimate, Llama405BTakesSecondsAndNoMemoryForWeights) {
  const std::vector<std::string> args = {"--job.config_file", kSource + "/configs/llama3_405b.toml",
                                         "--parallelism.tensor_parallel_degree", "1"};
  mem::PeakScope scope;
  const auto start = std::chrono::steady_clock::now();
  const Estimate e = estimate_of(args, 128);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 60.0);  // about 1.5 s on an idle core, for four dry runs of three steps
  EXPECT_LT(scope.peak_above_start(), 64 << 20) << "bytes of CPU tensors";
  EXPECT_EQ(e.model.params, 405853388800);
  EXPECT_EQ(e.shard_degree, 128);
  EXPECT_FALSE(e.fits) << format_estimate(e);
}

TEST(Estimate, TheVerdictComparesThePeakWithTheDeviceCapacity) {
  const std::vector<std::string> args = {"--model.flavor", "debugmodel", "--training.seq_len", "2048",
                                         "--training.local_batch_size", "8"};
  const Estimate roomy = estimate_of(args, 2);
  EXPECT_TRUE(roomy.fits);
  EXPECT_NE(format_estimate(roomy).find("verdict: fits"), std::string::npos) << format_estimate(roomy);
  const double just_under = static_cast<double>(roomy.peak_device) / (1 << 30) * 0.99;
  const Estimate tight = estimate_of(args, 2, "cuda", just_under);
  EXPECT_FALSE(tight.fits);
  EXPECT_NE(format_estimate(tight).find("verdict: does not fit"), std::string::npos) << format_estimate(tight);
}

// The activation checkpointing modes order as their memory does, and the report gives each.
TEST(Estimate, CheckpointingLessSavesMore) {
  const Estimate e = estimate_of({"--model.flavor", "debugmodel", "--activation_checkpoint.mode", "selective",
                                  "--activation_checkpoint.selective_ac_option", "2"},
                                 1);
  ASSERT_EQ(e.peak_by_ac.size(), 3u);
  const int64_t none = e.peak_by_ac.at("none"), full = e.peak_by_ac.at("full (every block)");
  EXPECT_EQ(e.peak_by_ac.at("selective 2 (1 block in 2)"), e.peak_device);
  EXPECT_LT(full, e.peak_device);
  EXPECT_LT(e.peak_device, none);
}

// activation_checkpoint.mode "memory_budget": the activations alive at the end of forward lie at most
// budget b of the way from checkpointing every block in full (b = 0, exactly full's) to none (b = 1,
// exactly none's), grow with b, and the plan names a mode for every block, the cheaper recomputation
// first (per operator before whole blocks). Under pipeline parallelism the bound holds for the worst
// pipeline rank and the plan covers the whole model's blocks.
TEST(Estimate, MemoryBudgetPlacesTheActivationsBetweenFullAndNone) {
  auto with = [](const std::vector<std::string>& ac, const std::vector<std::string>& more = {}, int64_t world = 1) {
    std::vector<std::string> a = {"--model.flavor", "debugmodel", "--training.seq_len", "1024"};
    a.insert(a.end(), ac.begin(), ac.end());
    a.insert(a.end(), more.begin(), more.end());
    return estimate_of(a, world);
  };
  const Estimate none = with({"--activation_checkpoint.mode", "none"});
  const Estimate full = with({"--activation_checkpoint.mode", "full"});
  ASSERT_LT(full.activations, none.activations);
  int64_t previous = 0;
  for (const double b : {0.0, 0.2, 0.4, 0.6, 0.8, 1.0}) {
    SCOPED_TRACE(b);
    const Estimate e = with({"--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget",
                             std::to_string(b)});
    ASSERT_EQ(e.ac_block_modes.size(), 6u);
    EXPECT_LE(e.activations, full.activations + b * (none.activations - full.activations) + 1);
    EXPECT_GE(e.activations, previous);
    previous = e.activations;
    const std::set<std::string> modes(e.ac_block_modes.begin(), e.ac_block_modes.end());
    if (b == 0.0) {
      EXPECT_EQ(e.activations, full.activations);
      EXPECT_EQ(modes, std::set<std::string>{"full"});
    } else if (b == 1.0) {
      EXPECT_EQ(e.activations, none.activations);
      EXPECT_EQ(modes, std::set<std::string>{"none"});
    } else {
      EXPECT_LE(modes.size(), 2u);  // two neighbouring rungs at most
      EXPECT_FALSE(modes.count("full") && modes.count("none"));  // per operator comes before whole blocks
    }
    EXPECT_NE(e.activation_checkpointing.find("memory budget"), std::string::npos) << e.activation_checkpointing;
    EXPECT_EQ(e.peak_by_ac.at(e.activation_checkpointing), e.peak_device);
  }
  const std::vector<std::string> pp2 = {"--parallelism.pipeline_parallel_degree", "2",
                                        "--parallelism.data_parallel_shard_degree", "1"};
  const Estimate pp_none = with({"--activation_checkpoint.mode", "none"}, pp2, 2);
  const Estimate pp_full = with({"--activation_checkpoint.mode", "full"}, pp2, 2);
  const Estimate pp_half =
      with({"--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", "0.5"}, pp2, 2);
  EXPECT_EQ(pp_half.ac_block_modes.size(), 6u);
  auto worst = [](const Estimate& e) {
    int64_t most = 0;
    for (const auto& r : e.pipeline_ranks) most = std::max(most, r.activations);
    return most;
  };
  EXPECT_LT(worst(pp_half), worst(pp_none));
  EXPECT_GT(worst(pp_half), worst(pp_full));
}

// The order memory_budget upgrades blocks in: a permutation whose every prefix of k blocks is spread
// over the layer ids (no gap between chosen ids, cyclically, above 2n/k + 1).
TEST(Estimate, MemoryBudgetUpgradeOrderSpreadsEveryPrefix) {
  for (int64_t n : {1, 2, 3, 6, 7, 32, 61, 126}) {
    SCOPED_TRACE(n);
    const std::vector<int64_t> order = memory_budget_upgrade_order(n);
    ASSERT_EQ(static_cast<int64_t>(order.size()), n);
    EXPECT_EQ(std::set<int64_t>(order.begin(), order.end()).size(), static_cast<size_t>(n));
    for (int64_t k = 1; k <= n; ++k) {
      std::vector<int64_t> chosen(order.begin(), order.begin() + k);
      std::sort(chosen.begin(), chosen.end());
      EXPECT_GE(chosen.front(), 0);
      EXPECT_LT(chosen.back(), n);
      int64_t gap = chosen.front() + n - chosen.back();
      for (size_t i = 1; i < chosen.size(); ++i) gap = std::max(gap, chosen[i] - chosen[i - 1]);
      EXPECT_LE(gap, 2 * n / k + 1) << "k " << k;
    }
  }
}

// resolve_memory_budget on a model of measurements whose pipeline ranks hold layers that are not
// contiguous (an interleaved schedule: rank 0 holds 0-3 and 17-20 of 32) and weigh differently (the
// first rank holds more microbatches in flight). For every budget: the bound holds, the plan is
// the first k blocks of the upgrade order at one rung over the rung below, and k - 1 would not meet
// the bound (the fewest); budgets 0 and 1 give all full and all none.
TEST(Estimate, MemoryBudgetChoosesTheFewestBlocksOnInterleavedRanks) {
  const std::vector<std::vector<int64_t>> ranks = {
      {0, 1, 2, 3, 17, 18, 19, 20}, {4, 5, 6, 7, 8, 21, 22, 23, 24}, {9, 10, 11, 12, 25, 26, 27, 28}, {13, 14, 15, 16, 29, 30, 31}};
  const std::map<std::string, int64_t> cost = {{"none", 100}, {"op_all_matmuls", 70}, {"op", 40}, {"full", 10}};
  const int64_t n = 32;
  int64_t measurements = 0;
  auto activations = [&](const std::vector<std::string>& modes) {
    ++measurements;
    EXPECT_EQ(static_cast<int64_t>(modes.size()), n);
    int64_t most = 0;
    for (size_t r = 0; r < ranks.size(); ++r) {
      int64_t sum = 0;
      for (int64_t b : ranks[r]) sum += cost.at(modes[b]);
      most = std::max(most, sum * static_cast<int64_t>(ranks.size() - r));  // rank r: pp - r microbatches
    }
    return most;
  };
  const std::vector<std::string> ladder = {"none", "op_all_matmuls", "op", "full"};
  const int64_t a_none = activations(std::vector<std::string>(n, "none"));
  const int64_t a_full = activations(std::vector<std::string>(n, "full"));
  const std::vector<int64_t> order = memory_budget_upgrade_order(n);
  for (int step = 0; step <= 40; ++step) {
    const double b = step / 40.0;
    SCOPED_TRACE(b);
    measurements = 0;
    const MemoryBudgetPlan plan = resolve_memory_budget(b, n, activations);
    EXPECT_LE(measurements, 4 + 6);  // the four rungs, then a bisection over 32 blocks
    const double target = a_full + b * static_cast<double>(a_none - a_full);
    ASSERT_EQ(static_cast<int64_t>(plan.block_modes.size()), n);
    EXPECT_LE(activations(plan.block_modes), target);
    if (step == 0) EXPECT_EQ(activations(plan.block_modes), a_full);  // (blocks off the worst rank may stay cheaper)
    if (step == 40) EXPECT_EQ(std::set<std::string>(plan.block_modes.begin(), plan.block_modes.end()), std::set<std::string>{"none"});
    // Which rungs: the costliest present is `high`, the one below it `low`; the first k of the order
    // are at high, the others at low.
    size_t high = 0;
    for (size_t i = 0; i < ladder.size(); ++i)
      if (std::count(plan.block_modes.begin(), plan.block_modes.end(), ladder[i])) high = i;
    const int64_t k = std::count(plan.block_modes.begin(), plan.block_modes.end(), ladder[high]);
    if (high == 0 || k == n) continue;  // uniform: all none (budget 1), or one whole rung
    std::vector<std::string> expected(n, ladder[high - 1]);
    for (int64_t i = 0; i < k; ++i) expected[order[i]] = ladder[high];
    EXPECT_TRUE(plan.block_modes == expected) << plan.words;
    std::vector<std::string> fewer(n, ladder[high - 1]);
    for (int64_t i = 0; i + 1 < k; ++i) fewer[order[i]] = ladder[high];
    EXPECT_GT(activations(fewer), target) << "k - 1 = " << k - 1 << " blocks would do: " << plan.words;
  }
}

// One process in bf16 autocast (no FSDP): the dry run's layers take the dtypes a CUDA run's do. A
// float8 layer saves its input (as a bf16 linear layer does) and its fp32 weight, which is a
// parameter, where the bf16 layer saves autocast's bf16 copy of its weight: the float8 model's
// activations are the bf16 model's less those copies (2 bytes per converted weight element; the
// scales, a few bytes per layer, aside). The layers after a norm share its bf16 output: when the norm
// returned fp32 on the meta device, each float8 layer saved its own bf16 copy of it (here 3 x 8 x
// 2048 x 256 x 2 bytes per block more).
TEST(Estimate, Float8LayersSaveTheirInputsAsBf16LayersDo) {
  const std::vector<std::string> common = {"--model.flavor", "debugmodel", "--activation_checkpoint.mode", "none"};
  std::vector<std::string> f8 = common;
  for (const std::string a : {"--model.converters", "quantize.linear.float8", "--quantize.linear.float8.filter_fqns",
                              "output"})
    f8.push_back(a);
  const Estimate bf16 = estimate_of(common, 1), float8 = estimate_of(f8, 1);
  ASSERT_EQ(bf16.compute_dtype, "bfloat16");
  ASSERT_EQ(bf16.param_dtype, "float32");
  LanguageModel m = model_spec("llama3").build("debugmodel", at::TensorOptions().device(at::kMeta), 64);
  int64_t converted = 0;
  for (const auto& p : m->named_parameters())
    if (p.value().dim() == 2 && p.key().find("layers.") == 0) converted += p.value().numel();
  ASSERT_GT(converted, 0);
  const int64_t difference = bf16.activations - float8.activations;
  EXPECT_NEAR(static_cast<double>(difference), 2.0 * converted, 64 * 1024)
      << "bf16 " << bf16.activations << ", float8 " << float8.activations << ", weights " << converted;
  // The dry run of a CPU run takes the layers' CPU formulations on the meta device (fp32 throughout):
  // the float8 casts' fp32 temporaries, products of the float8 values in fp32.
  const Estimate cpu = estimate_of(f8, 1, "cpu");
  EXPECT_EQ(cpu.compute_dtype, "float32, float8 linear layers (recipe tensorwise)");
  EXPECT_GT(cpu.peak_device, 0);
}

// CPU offload to a GPU's host: the shards, gradient shards and optimizer state move to host memory.
TEST(Estimate, CpuOffloadMovesTheShardsToTheHost) {
  const std::vector<std::string> args = {"--model.flavor", "debugmodel", "--training.seq_len", "1024"};
  const Estimate on_device = estimate_of(args, 2);
  auto offload_args = args;
  offload_args.push_back("--training.enable_cpu_offload");
  const Estimate offloaded = estimate_of(offload_args, 2);
  EXPECT_EQ(offloaded.host, on_device.params + on_device.grads + on_device.optimizer);
  EXPECT_EQ(offloaded.peak_device, on_device.peak_device - offloaded.host);  // bf16 gathers already stage on the device
  // On the CPU there is nowhere to move them: the same memory.
  EXPECT_EQ(estimate_of(offload_args, 2, "cpu").peak_device, estimate_of(args, 2, "cpu").peak_device);
}

TEST(Estimate, LayoutsTitanCannotTrainAreUserErrorsNamingTheOption) {
  auto expect_refused = [](const std::vector<std::string>& args, int world, const std::string& option) {
    try {
      estimate_of(args, world);
      ADD_FAILURE() << "estimated: " << option;
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(option), std::string::npos) << e.what();
    }
  };
  expect_refused({"--parallelism.expert_parallel_degree", "2"}, 2, "expert_parallel_degree");  // a dense model
  // Pipeline and context parallelism are estimated, and refused where titan train refuses them.
  expect_refused({"--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "3"},
                 2, "pipeline_parallel_microbatch_size");
  expect_refused({"--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Zigzag"}, 2,
                 "Zigzag");
  expect_refused({"--parallelism.context_parallel_degree", "2", "--training.seq_len", "2046"}, 2, "training.seq_len");
  // Tensor parallelism is estimated, and refused where it does not divide the model.
  EXPECT_THROW(estimate_of({"--parallelism.tensor_parallel_degree", "3"}, 3), UserError);
  EXPECT_THROW(estimate_of({}, 3, "tpu"), UserError);
  EXPECT_THROW(estimate_of({"--parallelism.data_parallel_shard_degree", "2"}, 3), UserError);
}

// TP shards every weight but the norms: the held state per rank drops by about the degree, and the
// layout says so.
TEST(Estimate, TensorParallelDividesTheHeldState) {
  const std::vector<std::string> base = {"--job.config_file", kSource + "/configs/llama3_8b.toml", "--training.seq_len",
                                         "2048", "--training.local_batch_size", "1"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const Estimate fsdp8 = estimate_of(with({}), 8);
  const Estimate tp8 = estimate_of(with({"--parallelism.tensor_parallel_degree", "8"}), 8);
  const Estimate tp2fsdp4 = estimate_of(with({"--parallelism.tensor_parallel_degree", "2"}), 8);
  EXPECT_NE(tp8.layout.find("TP 8"), std::string::npos) << tp8.layout;
  EXPECT_NE(tp2fsdp4.layout.find("FSDP + TP 2"), std::string::npos) << tp2fsdp4.layout;
  // FSDP 8 and TP 8 each hold 1/8 of the parameters (TP keeps whole norms: a little more).
  EXPECT_NEAR(static_cast<double>(tp8.params) / static_cast<double>(fsdp8.params), 1.0, 0.01);
  EXPECT_NEAR(static_cast<double>(tp2fsdp4.params) / static_cast<double>(fsdp8.params), 1.0, 0.01);
  // TP 8 communicates activations over tp, FSDP 8 parameters over dp_shard_cp.
  EXPECT_GT(tp8.comm_bytes.at("tp").at("all_gather"), 0);
  EXPECT_EQ(tp8.comm_bytes.count("dp_shard_cp"), 0u);
}

// Each pipeline rank holds as many microbatches' activations as its order keeps between a forward
// and the backward that releases them: GPipe all of them, 1F1B min(pp - rank, microbatches); the
// ranks that hold more peak higher.
TEST(Estimate, PipelineRanksHoldTheActivationsTheirScheduleKeeps) {
  auto pp4 = [](const std::string& schedule) {
    return estimate_of({"--parallelism.pipeline_parallel_degree", "4", "--parallelism.data_parallel_shard_degree", "1",
                        "--parallelism.pipeline_parallel_schedule", schedule, "--training.seq_len", "256",
                        "--training.local_batch_size", "8", "--activation_checkpoint.mode", "none"},
                       4, "cpu");
  };
  const Estimate gpipe = pp4("GPipe"), one_f_one_b = pp4("1F1B");
  ASSERT_EQ(gpipe.pipeline_ranks.size(), 4u);
  ASSERT_EQ(one_f_one_b.pipeline_ranks.size(), 4u);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(gpipe.pipeline_ranks[r].stages, std::vector<int>{r});
    EXPECT_EQ(gpipe.pipeline_ranks[r].in_flight, 8);
    EXPECT_EQ(one_f_one_b.pipeline_ranks[r].in_flight, 4 - r);
    // The middle stages hold two blocks each: activations follow the microbatches in flight.
    if (r == 1 || r == 2) {
      EXPECT_GT(gpipe.pipeline_ranks[r].activations, 2 * one_f_one_b.pipeline_ranks[r].activations) << "rank " << r;
    }
  }
  EXPECT_GT(one_f_one_b.pipeline_ranks[1].activations, one_f_one_b.pipeline_ranks[2].activations);
  // The stages' FLOPs add up to the model's.
  double flops = 0;
  for (const auto& pr : one_f_one_b.pipeline_ranks) flops += pr.flops_per_step;
  EXPECT_NEAR(flops / (one_f_one_b.model.flops_per_token * 8 * 256), 1.0, 1e-9);
  EXPECT_GT(gpipe.peak_device, one_f_one_b.peak_device);
  EXPECT_NE(format_estimate(one_f_one_b).find("pipeline: 4 stages over 4 ranks, schedule 1F1B, 8 microbatches"),
            std::string::npos) << format_estimate(one_f_one_b);
}

// What crosses a stage boundary per microbatch is microbatch x (seq / tp under sequence parallel) x
// dim in the compute dtype (bf16 under FSDP on CUDA); each rank sends one activation per boundary
// it feeds and one gradient per boundary it feeds back, and receives the mirror image
// (pipeline_train_test.cpp counts the same in real runs).
TEST(Estimate, PipelineBoundaryBytesAreMicrobatchTimesSequenceTimesWidth) {
  for (const std::string schedule : {"1F1B", "Interleaved1F1B"}) {
    SCOPED_TRACE(schedule);
    const Estimate e = estimate_of({"--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree",
                                    "2", "--parallelism.pipeline_parallel_schedule", schedule,
                                    "--parallelism.pipeline_parallel_microbatch_size", "2", "--training.seq_len", "256",
                                    "--training.local_batch_size", "8"},
                                   8);
    const int64_t message = 2 * (256 / 2) * 256 * 2;  // microbatch x seq / tp x dim x bf16
    const int stages = schedule == "1F1B" ? 2 : 4;
    ASSERT_EQ(e.num_stages, stages);
    ASSERT_EQ(e.microbatches, 4);
    for (const auto& pr : e.pipeline_ranks) {
      int64_t messages = 0;  // every boundary crosses ranks here (stages alternate between the two)
      for (int s = 0; s + 1 < stages; ++s) {
        const bool mine = std::count(pr.stages.begin(), pr.stages.end(), s) + std::count(pr.stages.begin(), pr.stages.end(), s + 1);
        if (mine) messages += e.microbatches;
      }
      EXPECT_EQ(pr.comm_bytes.at("pp").at("send"), messages * message) << "rank " << pr.rank;
      EXPECT_EQ(pr.comm_bytes.at("pp").at("recv"), messages * message) << "rank " << pr.rank;
    }
  }
}

// Ring attention's K/V traffic with the all-gather method, per block and microbatch: forward
// all-gathers every rank's K and V (cp x B x kv_heads x S/cp x head_dim x 2, compute dtype),
// backward all-gathers them again and reduce-scatters their gradients (as large, fp32); the loss is
// summed over cp. Each rank attends with S/cp tokens: its activations are those of FSDP on as many
// ranks with 1/cp of the batch (the same tokens per rank), half of FSDP's at the same batch.
TEST(Estimate, ContextParallelMovesKeysAndValuesAndHoldsTheRanksPart) {
  auto run = [](int64_t cp, int64_t batch) {
    return estimate_of({"--training.seq_len", "1024", "--training.local_batch_size", std::to_string(batch),
                        "--activation_checkpoint.mode", "none", "--parallelism.context_parallel_degree",
                        std::to_string(cp)},
                       4, "cpu");
  };
  const Estimate cp2 = run(2, 2), fsdp4 = run(1, 2), fsdp4_half_batch = run(1, 1);
  EXPECT_NE(cp2.layout.find("FSDP + CP 2"), std::string::npos) << cp2.layout;
  EXPECT_EQ(cp2.shard_degree, 4);  // FSDP shards over dp_shard x cp
  EXPECT_EQ(cp2.params, fsdp4.params);
  const int64_t layers = 6, kv = 2 * 2 * 16 * 1024 * 16 * 4;  // K and V: B x kv heads x S x head_dim, fp32
  EXPECT_EQ(cp2.comm_bytes.at("cp").at("all_gather"), 2 * layers * kv);
  EXPECT_EQ(cp2.comm_calls.at("cp").at("all_gather"), 2 * layers);
  EXPECT_EQ(cp2.comm_bytes.at("cp").at("reduce_scatter"), layers * kv);
  EXPECT_EQ(cp2.comm_bytes.at("cp").at("all_reduce"), 4);  // the loss
  EXPECT_NEAR(static_cast<double>(cp2.activations) / static_cast<double>(fsdp4_half_batch.activations), 1.0, 0.05);
  EXPECT_NEAR(static_cast<double>(cp2.activations) / static_cast<double>(fsdp4.activations), 0.5, 0.05);
}

TEST(Estimate, ExpertParallelSplitsTheExpertsAndCountsTheAllToAlls) {
  // Qwen3's debug MoE model (8 MoE layers of 64 experts, 8 per token, dim 256) on 4 ranks: FSDP
  // alone, then the experts split over the 4 ranks (routing taken as balanced).
  auto run = [](int64_t ep, const std::string& aux_coeff = "0") {
    return estimate_of({"--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--training.seq_len", "256",
                        "--training.local_batch_size", "1", "--activation_checkpoint.mode", "none",
                        "--parallelism.expert_parallel_degree", std::to_string(ep), "--model.moe_aux_loss_coeff",
                        aux_coeff},
                       4, "cpu");
  };
  const Estimate fsdp = run(1), ep4 = run(4), ep4_aux = run(4, "0.001");
  EXPECT_NE(ep4.layout.find("EP 4 (experts FSDP over 1; routing taken as balanced)"), std::string::npos) << ep4.layout;
  EXPECT_EQ(ep4.params, fsdp.params);  // the experts are split 4 ways either way
  // Per MoE layer and step: the counts (16 experts' int64 to each of 3 ranks), then the routed
  // copies that cross ranks (3/4 of 256 x 8) x dim 256 x 4 bytes, four times (dispatch and combine,
  // forward and backward).
  const int64_t layers = 8, crossing = 256 * 8 * 3 / 4;
  EXPECT_EQ(ep4.comm_bytes.at("ep").at("all_to_all"), layers * (16 * 8 * 3 + 4 * crossing * 256 * 4));
  EXPECT_EQ(ep4.comm_calls.at("ep").at("all_to_all"), layers * 5);
  EXPECT_FALSE(fsdp.comm_bytes.count("ep"));
  // The experts' gathers move a quarter of the expert weights FSDP alone gathers: each rank gathers
  // only its own experts (over efsdp, one rank here: nothing moves).
  EXPECT_FALSE(ep4.comm_bytes.count("efsdp"));
  EXPECT_LT(ep4.comm_bytes.at("dp_shard_cp").at("all_gather"), fsdp.comm_bytes.at("dp_shard_cp").at("all_gather") / 10);
  // Once per step the layers' counts (fp32, layers x 64) are summed over dp x cp for the routing
  // biases; with the auxiliary loss each forward also sums its layer's counts (64 fp32), and the
  // step's sum carries each layer's loss terms too (a 65th column).
  EXPECT_EQ(ep4.comm_bytes.at("dp_cp").at("all_reduce"), layers * 64 * 4);
  EXPECT_EQ(ep4.comm_calls.at("dp_cp").at("all_reduce"), 1);
  EXPECT_EQ(ep4_aux.comm_bytes.at("dp_cp").at("all_reduce"), layers * 64 * 4 + layers * 65 * 4);
  EXPECT_EQ(ep4_aux.comm_calls.at("dp_cp").at("all_reduce"), layers + 1);
}

TEST(EstimateCli, RefusesTheAuxiliaryLossOnADenseModel) {
  auto r = test::run_process({kTitan, "estimate", "--job.config_file", kSource + "/configs/llama3_8b.toml",
                              "--world-size", "8", "--model.moe_aux_loss_coeff", "0.001"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("model llama3 8B has no MoE layers"), std::string::npos) << r.output;
}

TEST(EstimateCli, PrintsThePerRankReportAndTheVerdict) {
  auto r = test::run_process({kTitan, "estimate", "--job.config_file", kSource + "/configs/llama3_8b.toml",
                              "--world-size", "8", "--device-memory-gib", "80"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const char* s : {"llama3 8B", "8 ranks", "FSDP", "parameters", "optimizer state", "peak", "dp_shard_cp:",
                        "all_gather", "reduce_scatter", "verdict:"})
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  auto bad = test::run_process({kTitan, "estimate", "--world-size", "zero"});
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_NE(bad.output.find("--world-size"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace titan
