#include "titan/trainer/trainer.h"

#include "titan/common/autocast.h"
#include "titan/common/error.h"
#include "titan/common/fault_injection.h"
#include "titan/common/host_reads.h"
#include "titan/common/memory_tracker.h"
#include "titan/common/progress_text.h"
#include "titan/common/tensor_storage.h"
#include "titan/common/trace.h"
#include "titan/components/checkpoint/hf.h"
#include "titan/components/checkpoint/safetensors.h"
#include "titan/components/metrics/format.h"
#include "titan/config/field.h"
#include "titan/distributed/options.h"
#include "titan/distributed/process_group.h"

#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <optional>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <sstream>
#include <unordered_map>

#include <time.h>    // clock_gettime(CLOCK_BOOTTIME)
#include <stdlib.h>  // setenv
#include <unistd.h>  // sysconf(_SC_CLK_TCK)

namespace titan {

// The ranks' preemption vote: the largest ballot (a signal number, 0 for none) over every rank, in
// two levels (the node's ranks, then the nodes' first ranks, then back to the node's ranks), run in a
// thread of its own so that the training thread never waits on it until it reads the result a step
// later. One vote at a time.
class PreemptionVoter {
 public:
  PreemptionVoter(dist::Group& node, dist::Group* nodes, bool two_levels)
      : node_(node), nodes_(nodes), two_levels_(two_levels) {}
  // A vote running when the trainer ends normally has every rank's ballot coming: it is waited for.
  // While an error unwinds, it is left to its thread (the groups are kept: Mesh's destructor).
  ~PreemptionVoter() {
    if (state_ && std::uncaught_exceptions() == 0) {
      std::unique_lock<std::mutex> lock(state_->mutex);
      state_->cv.wait(lock, [&] { return state_->done; });
    }
  }
  bool pending() const { return state_ != nullptr; }
  void issue(int ballot) {
    TITAN_ASSERT(!state_, "a preemption vote is already in flight");
    auto state = std::make_shared<State>();
    std::thread([state, node = &node_, nodes = nodes_, two_levels = two_levels_, ballot] {
      try {
        at::Tensor b = at::full({1}, ballot, at::kInt);
        node->all_reduce(b, c10d::ReduceOp::MAX).wait();
        if (nodes) nodes->all_reduce(b, c10d::ReduceOp::MAX).wait();
        if (two_levels) node->broadcast(b, 0).wait();
        state->result = b.item<int>();
      } catch (...) {
        state->error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(state->mutex);
      state->done = true;
      state->cv.notify_all();
    }).detach();
    state_ = std::move(state);
  }
  // The result of the vote in flight (waiting for it); rethrows its failure.
  int read() {
    std::shared_ptr<State> state = std::move(state_);
    std::unique_lock<std::mutex> lock(state->mutex);
    state->cv.wait(lock, [&] { return state->done; });
    if (state->error) std::rethrow_exception(state->error);
    return state->result;
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable cv;
    bool done = false;
    int result = 0;
    std::exception_ptr error;
  };
  dist::Group& node_;
  dist::Group* nodes_;
  bool two_levels_;
  std::shared_ptr<State> state_;
};

namespace {
using Clock = std::chrono::steady_clock;

MemoryBudgetPlanner& memory_budget_planner() {
  static MemoryBudgetPlanner planner;
  return planner;
}

// Seconds since this process started: its start time in /proc/self/stat (field 22, clock ticks
// since boot) against CLOCK_BOOTTIME. 0 where that is unavailable.
double seconds_since_process_start() {
  std::ifstream f("/proc/self/stat");
  const std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return 0;
  std::istringstream fields(stat.substr(paren + 1));  // field 3 (state) onwards
  std::string field;
  for (int i = 3; i <= 22 && fields >> field; ++i) {
  }
  timespec now{};
  if (field.empty() || clock_gettime(CLOCK_BOOTTIME, &now) != 0) return 0;
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec) -
         std::stod(field) / static_cast<double>(sysconf(_SC_CLK_TCK));
}
}  // namespace

void Trainer::log_info(const std::string& msg) const {
  if (env_.rank != 0) return;
  if (metrics_) metrics_->clear_progress();  // no line lands after a half-drawn progress line
  std::cout << metrics::log_prefix() << msg << std::endl;
}

void Trainer::log_warning(const std::string& msg) const {
  if (env_.rank != 0) return;
  if (metrics_) metrics_->clear_progress();
  std::cerr << metrics::log_prefix("WARNING") << msg << std::endl;
}

std::string Trainer::restart_note() const {
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const int n = attempt ? std::atoi(attempt) : 0;
  return n > 0 ? "Restart " + std::to_string(n) + ": " : "";
}

// Ranks from the launcher's environment, the degrees, the device of this rank and every process
// group (through the mesh, the one owner of groups).
void Trainer::set_up_distributed() {
  env_ = dist::launch_env_from_environment();
  dims_ = std::make_unique<dist::ParallelDims>(dist::parallel_dims(cfg_.parallelism, env_.world_size));
  check_supported(cfg_, env_.world_size);
  if (torch::cuda::is_available()) {
    const int index = dist::local_device_index(env_, static_cast<int>(torch::cuda::device_count()),
                                               std::getenv("CUDA_VISIBLE_DEVICES") != nullptr);
    device_ = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device_);
  }
  // The flight recorder's settings, read by LibTorch when the first process group is made.
  const std::string traces = (std::filesystem::path(cfg_.job.dump_folder) / cfg_.comm.save_traces_folder).string();
  for (const auto& changed : dist::configure_flight_recorder(cfg_.comm.trace_buf_size, traces,
                                                             cfg_.comm.save_traces_file_prefix, device_.is_cuda()))
    log_warning("the environment's " + changed + " follows [comm] trace_buf_size / save_traces_folder / "
                "save_traces_file_prefix");
  if (device_.is_cuda() && cfg_.comm.trace_buf_size > 0)
    log_info("Flight recorder: the last " + std::to_string(cfg_.comm.trace_buf_size) +
             " collectives of each rank, written to " + traces + "/" + cfg_.comm.save_traces_file_prefix +
             "<rank> if an NCCL collective times out");
  store_ = c10::make_intrusive<c10d::HashStore>();
  const auto timeout = std::chrono::seconds(cfg_.comm.init_timeout_seconds);
  if (env_.world_size > 1) {
    store_ = dist::connect_store(env_, timeout);  // torchrun's agent store: keys per restart attempt
    dist::wait_for_every_rank(store_, env_, timeout);
  }
  const bool multi_node = env_.world_size > env_.local_world_size;
  mesh_ = std::make_unique<dist::Mesh>(*dims_, env_.rank, store_,
                                       device_.is_cuda() ? dist::BackendKind::NCCL : dist::BackendKind::Gloo, timeout,
                                       multi_node ? "" : "127.0.0.1");
}

std::map<std::string, at::Tensor> Trainer::full_parameters() {
  std::map<std::string, at::Tensor> out;
  for_each_full_parameter([&](const std::string& name, const at::Tensor& t) { out[name] = t.to(at::kCPU, at::kFloat); });
  return out;
}

std::string config_changes(const JobConfig& cfg) {
  JobConfig a = cfg, defaults;
  auto now = config::fields_of(a), base = config::fields_of(defaults);
  std::string out;
  for (size_t i = 0; i < now.size(); ++i) {
    const std::string v = config::format_value(now[i].value);
    if (v != config::format_value(base[i].value)) out += now[i].path() + " = " + v + "\n";
  }
  return out;
}

Trainer::Trainer(JobConfig cfg, const std::function<void()>& preflight) : cfg_(std::move(cfg)) {
  const auto& tr = cfg_.training;
  mem::install_cpu_tracking();  // before any tensor: the CPU memory figures count every one
  mem::PhaseScope setup_phase(mem::Phase::Setup);  // parameters, buffers, data structures

  // ---- processes, mesh, device, seed, determinism, precision
  set_up_process();
  const Precision precision = resolve_precision();

  // ---- cheap checks before anything expensive (the model's build, its memory)
  check_before_build();

  if (preflight) on_every_rank(preflight, "pass the pre-flight memory check");

  // ---- tokenizer and model
  {
    const auto tokenizer_start = Clock::now();
    tokenizer_ = load_tokenizer(cfg_.model.hf_assets_path);
    char line[256];
    std::snprintf(line, sizeof line, "Tokenizer: %s, vocabulary %lld (%.2f s)", cfg_.model.hf_assets_path.c_str(),
                  static_cast<long long>(tokenizer_->vocab_size()),
                  std::chrono::duration<double>(Clock::now() - tokenizer_start).count());
    log_info(line);
  }
  const ModelSpec& spec = model_spec(cfg_.model.name);
  log_info("Model " + cfg_.model.name + " " + cfg_.model.flavor + ": building, initializing and sharding it on " +
           device_.str() + " ...");
  float8_ = float8_conversion(cfg_, dims_->tp());  // its options checked before the model is built
  const auto model_start = Clock::now();  // build, initialization and sharding: for the start-up line
  // Long enough for the validation sequences too (the RoPE table is built per sequence length).
  const int64_t max_seq_len = std::max(tr.seq_len, cfg_.validation.enable ? cfg_.validation.seq_len : int64_t{0});
  {
    // Parameters get memory and values only once their layout is known: FSDP fills each rank's
    // rows of a unit while sharding it, the other layouts each rank's local tensor (a TP shard or
    // the whole parameter) when the data-parallel layer finishes.
    DeferAllocation defer;
    model_ = spec.build(cfg_.model.flavor, at::TensorOptions().device(device_).dtype(precision.param_dtype), max_seq_len);
  }
  // Model converters (float8) before the parallelisms, as torchtitan applies them.
  convert_to_float8(*model_, float8_, cfg_.float8);
  check_float8_on_cuda();
  model_record_ = checkpoint::model_record(spec, cfg_.model.flavor);
  const int64_t vocab = model_->vocab_size();
  TITAN_USER_CHECK(tokenizer_->vocab_size() <= vocab, "the tokenizer at ", cfg_.model.hf_assets_path, " has ",
                   tokenizer_->vocab_size(), " tokens but model ", cfg_.model.name, " ", cfg_.model.flavor,
                   " has a vocabulary of ", vocab, ": choose the flavor's tokenizer with --model.hf_assets_path");

  // ---- parallelisms, applied by the model's parallelize function
  const dist::DataParallelOptions dpo = apply_parallelisms(spec, precision, max_seq_len);
  const double model_seconds = std::chrono::duration<double>(Clock::now() - model_start).count();
  const std::vector<std::pair<std::string, at::Tensor>> named = collect_parameters();

  // ---- optimizer and learning-rate schedule
  optimizer_ = std::make_unique<Optimizer>(named, optimizer_options(cfg_.optimizer));
  if (cfg_.optimizer.early_step_in_backward) set_up_early_step();
  lr_schedule_ = std::make_unique<LRSchedule>(lr_schedule_options(cfg_.lr_scheduler),
                                              cfg_.lr_scheduler.total_steps.value_or(tr.steps));

  // ---- data: each data-parallel rank reads its local_batch_size part of every global batch, in
  // gradient_accumulation_steps micro-batches
  const int64_t dp = dims_->dp_size();
  const int64_t global_batch = global_batch_size(cfg_, dp);
  grad_accum_steps_ = global_batch / (tr.local_batch_size * dp);
  set_up_moe_aux_loss();
  data::DataConfig dc = data::data_config(tr, (*mesh_)["dp"].rank(), static_cast<int>(dp));
  dc.together = tokenize_together("data_training");
  dataloader_ = data::make_dataloader(dc, *tokenizer_);

  // ---- metrics
  metrics::MetricsOptions mo = metrics::metrics_options(cfg_.metrics, cfg_.job, tr.steps);
  mo.device = device_;
  mo.rank = env_.rank;
  mo.non_data_parallel_size = dims_->non_data_parallel_size();
  metrics_ = std::make_unique<metrics::MetricsLogger>(mo);

  // ---- profiler traces and memory snapshots at the configured steps
  if (std::optional<metrics::ProfilerOptions> po = metrics::profiler_options(cfg_.profiling, cfg_.job)) {
    po->rank = env_.rank;
    po->device = device_;
    po->log = [this](const std::string& line) { log_info(line); };
    profiler_ = std::make_unique<metrics::Profiler>(*po);
  }

  // ---- what this run is, for the log
  int64_t float8_gathered = 0;
  for (const auto& d : data_parallel_)
    if (d->fsdp()) float8_gathered += d->fsdp()->num_float8_gathered();
  precompute_float8_scales_ =
      dpo.fsdp.float8_all_gather && float8_gathered > 0 && cfg_.float8.precompute_float8_dynamic_scale_for_fsdp;
  log_run(model_seconds, global_batch, dpo.fsdp.float8_all_gather, float8_gathered);

  set_up_validation();

  // ---- checkpoints: resume from the latest one in the folder (or the initial load)
  set_up_checkpointing();
  // Set up: the run's config and the start of its records (a run that fails before this leaves the
  // folder's earlier records alone).
  if (env_.rank == 0) std::ofstream(saved_config_path()) << to_toml(cfg_);
  metrics_->record_start(step_);
  char buf[160];
  std::snprintf(buf, sizeof buf, "Start-up: %.2f s (the model's build, initialization and sharding %.2f s)",
                seconds_since_process_start(), model_seconds);
  log_info(buf);
}


// fp32 master weights. On CUDA, mixed_precision_param bfloat16 computes in bf16: FSDP all-gathers
// bf16 parameters; without FSDP the forward runs under bf16 autocast (as torchtitan does).
Trainer::Precision Trainer::resolve_precision() {
  const auto& tr = cfg_.training;
  Precision p;
  p.param_dtype = tr.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  p.bf16_compute = device_.is_cuda() && tr.mixed_precision_param == "bfloat16" && p.param_dtype == at::kFloat;
  // CPU offload keeps FSDP's shards in CPU memory: it shards over dp_shard_cp even when that is one
  // rank (one GPU, or replicas only), as torchtitan's fully_shard with an offload policy does.
  p.use_fsdp = dims_->fsdp_enabled() || tr.enable_cpu_offload;
  TITAN_USER_CHECK(!p.use_fsdp || p.param_dtype == at::kFloat, "training.dtype bfloat16 with FSDP",
                   tr.enable_cpu_offload ? " (CPU offload shards with FSDP)" : "",
                   dims_->cp() > 1 ? " (context parallelism shards the parameters over dp_shard x cp with FSDP)" : "",
                   " is not supported; FSDP keeps fp32 shards (use float32)");
  bf16_autocast_ = p.bf16_compute && !p.use_fsdp;
  return p;
}

// Tensor parallelism inside, FSDP/HSDP/DDP/none outside, through the model's parallelize function
// (or its pipeline stages'); every parameter's values depend on (seed, name) only, whatever the
// layout. Returns the data-parallel options used.
dist::DataParallelOptions Trainer::apply_parallelisms(const ModelSpec& spec, const Precision& precision,
                                                      int64_t max_seq_len) {
  const auto& tr = cfg_.training;
  const auto& par = cfg_.parallelism;
  const uint64_t seed = this->seed();
  dist::DataParallelOptions dpo = dist::data_parallel_options(par, tr, dims_->pp() > 1, precision.bf16_compute);
  dpo.fsdp.float8_all_gather = float8_.recipe && cfg_.float8.enable_fsdp_float8_all_gather;
  // A large model's initialization takes a while (a 1B model about 15 s on a CPU): a line every 5 s
  // says which layer it has reached.
  std::vector<std::string> parameter_names;
  for (const auto& p : model_->named_parameters()) parameter_names.push_back(p.key());
  auto init_progress = std::make_shared<PhaseProgress>(
      "Model: initializing", count_layers(parameter_names), 5.0, [this](const std::string& line) { log_info(line); });
  auto make_data_parallel = [&, seed, init_progress] {
    return std::make_unique<dist::DataParallel>(
        (*mesh_)["dp_shard_cp"], (*mesh_)["dp_replicate"], dpo,
        [this, seed, init_progress](const std::string& name, at::Tensor out, const std::vector<int64_t>& begin) {
          init_progress->reached(name);
          model_->init_region(seed, name, std::move(out), begin);
        },
        mesh_->device(), dims_->ep() > 1 ? &(*mesh_)["efsdp"] : nullptr);
  };
  if (dims_->tp() > 1) {
    const dist::TensorParallelOptions tpo = dist::tensor_parallel_options(par);
    dist::check_sequence_length(tr.seq_len, dims_->tp(), tpo.sequence_parallel);
    tensor_parallel_ = std::make_unique<dist::TensorParallel>((*mesh_)["tp"], tpo);
  }
  if (dims_->cp() > 1) {
    const auto cpo = dist::context_parallel_options(par.context_parallel_load_balancer, par.context_parallel_rotate_method);
    dist::check_context_parallel_sequence(tr.seq_len, dims_->cp(), cpo.load_balance, dims_->tp(),
                                          dims_->tp() > 1 && par.enable_sequence_parallel);
    context_parallel_ = std::make_unique<dist::ContextParallel>((*mesh_)["cp"], cpo);
  }
  if (dims_->ep() > 1) expert_parallel_ = std::make_unique<dist::ExpertParallel>((*mesh_)["ep"]);
  TITAN_ASSERT(spec.parallelize, "model ", spec.name, " has no parallelize function");
  ParallelizeContext pctx;
  pctx.tensor_parallel = tensor_parallel_.get();
  pctx.context_parallel = context_parallel_.get();
  pctx.expert_parallel = expert_parallel_.get();
  set_activation_checkpointing(pctx, cfg_.activation_checkpoint);
  if (pctx.ac_mode == "memory_budget") {
    TITAN_ASSERT(memory_budget_planner(), "no memory_budget planner installed (set_memory_budget_planner)");
    MemoryBudgetPlan budget;
    try {
      budget = memory_budget_planner()(cfg_, env_.world_size, device_.is_cuda() ? "cuda" : "cpu");
    } catch (const UserError&) {
      throw;  // what is wrong with the config, said as titan estimate says it
    } catch (const std::exception& e) {
      throw UserError(std::string("activation_checkpoint.mode 'memory_budget' places the activations by dry runs "
                                  "of this config (titan estimate's), which failed: ") +
                      e.what() + "\nChoose another activation_checkpoint.mode (full, selective or none)");
    }
    pctx.ac_mode = "per_block";
    pctx.ac_block_modes = std::move(budget.block_modes);
    ac_plan_words_ = budget.words;
  }
  if (dims_->pp() > 1) {
    // The whole model above holds only shapes (for initialization and the figures); the stages hold
    // the parameters. Hidden states cross between stages in the compute dtype (FSDP's param_dtype).
    set_up_pipeline(spec, pctx, make_data_parallel, at::TensorOptions().device(device_).dtype(precision.param_dtype),
                    max_seq_len, precision.use_fsdp ? dpo.fsdp.param_dtype : precision.param_dtype);
  } else {
    data_parallel_.push_back(make_data_parallel());
    pctx.data_parallel = data_parallel_[0].get();
    parallelized_ = spec.parallelize(*model_, pctx);
  }
  return dpo;
}

void Trainer::set_up_process() {
  fault::check_environment();
  // One run per dump folder, held by rank 0 from before the other ranks meet it (a refused run
  // stops there; the launcher stops the other ranks).
  if (dist::launch_env_from_environment().rank == 0)
    dump_lock_ = std::make_unique<FolderLock>(cfg_.job.dump_folder, "job.dump_folder");
  // From here a preemption signal is a request, answered at the first step boundary (a signal during
  // start-up stops the run before its first step).
  if (!cfg_.job.preemption_signals.empty()) {
    std::vector<int> signals;
    for (const std::string& name : cfg_.job.preemption_signals) signals.push_back(preemption_signal_number(name));
    preemption_ = std::make_unique<PreemptionHandler>(signals, cfg_.job.preemption_grace_seconds);
  }
  set_up_distributed();
  if (preemption_) {
    const auto timeout = std::chrono::seconds(cfg_.comm.init_timeout_seconds);
    const auto [node, nodes] =
        mesh_->host_groups_by_block("preemption", env_.local_world_size, timeout, timeout, "comm.init_timeout_seconds");
    preemption_voter_ = std::make_shared<PreemptionVoter>(*node, nodes, node->size() < env_.world_size);
  }
  // What this run is, said as start-up goes (each phase logs when it is done, with its time).
  const std::string saved_config = saved_config_path();
  log_info("Starting job: " + cfg_.job.description);
  log_info("Processes: " + dist::describe(env_) + "; parallelism " + dims_->describe());
  if (cfg_.job.print_config && env_.rank == 0) {
    std::cout << to_toml(cfg_);
  } else {
    log_info("Config (differences from the defaults; full config in " + saved_config + "):\n" + config_changes(cfg_));
  }
  for (const auto& w : config_warnings(cfg_)) log_warning(w);
  at::manual_seed(seed());
  if (cfg_.debug.deterministic) {
    // cuBLAS reproducible only with a fixed workspace: without it deterministic mode throws at the
    // first CUDA matmul. Read when cuBLAS creates its handle (not yet: no matmul has run); a value
    // the user set is kept.
    ::setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", /*overwrite=*/0);
    at::globalContext().setDeterministicAlgorithms(true, cfg_.debug.deterministic_warn_only);
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
  }
}

// Every rank reads the same global sample stream (each keeps its own samples of it), so the ranks of
// a node share the text's tokenization: each encodes 1/local_world_size of the documents (text data
// only; token files need none). Across nodes each node tokenizes the stream itself: the exchange stays
// within a node, however many nodes train.
data::TokenizeTogether Trainer::tokenize_together(const std::string& name) {
  const int local = env_.local_world_size;
  if (local <= 1 || env_.world_size % local != 0) return {};
  // Each rank tokenizing the whole stream, as before: the peer of bench/data's measurement.
  if (const char* alone = std::getenv("TITAN_DEBUG_TOKENIZE_ALONE"); alone && std::string(alone) == "1") return {};
  std::vector<int> members;
  for (int r = env_.rank - env_.local_rank; r < env_.rank - env_.local_rank + local; ++r) members.push_back(r);
  if (members.front() < 0 || members.back() >= env_.world_size) return {};  // ranks not laid out node by node
  const auto timeout = std::chrono::seconds(cfg_.comm.init_timeout_seconds);
  dist::Group& group = mesh_->host_group(name, members, timeout, timeout, "comm.init_timeout_seconds");
  if (timeout_set_) group.set_timeout(std::chrono::seconds(cfg_.comm.train_timeout_seconds), "comm.train_timeout_seconds");
  if (std::find(data_groups_.begin(), data_groups_.end(), &group) == data_groups_.end()) data_groups_.push_back(&group);
  return data::tokenize_together(group);
}

std::string Trainer::saved_config_path() const {
  return cfg_.job.dump_folder + "/" + (cfg_.job.save_config_file.empty() ? "config.toml" : cfg_.job.save_config_file);
}

uint64_t Trainer::seed() const { return static_cast<uint64_t>(cfg_.debug.seed.value_or(0)); }

// The data's files, the batch arithmetic, the output folders and the initial load path: mistakes
// found in seconds, before the model's build and its memory.
void Trainer::check_before_build() {
  const auto& tr = cfg_.training;
  if (tr.dataset_mix.empty()) {
    (void)data::resolve_dataset(tr.dataset, tr.dataset_path, "training");
  } else {
    TITAN_USER_CHECK(tr.dataset_path.empty(), "training.dataset_mix and training.dataset_path are both set: the "
                     "mixture names its datasets' paths; clear one of them");
    (void)data::resolve_mixture(tr.dataset_mix, "training");
  }
  if (cfg_.validation.enable) {
    try {
      (void)data::resolve_dataset(cfg_.validation.dataset, cfg_.validation.dataset_path, "validation");
    } catch (const UserError& e) {
      throw UserError(std::string("validation data: ") + e.what());
    }
  }
  {
    (void)global_batch_size(cfg_, dims_->dp_size());  // a whole number of local batches per rank
    const auto& c = cfg_.checkpoint;
    std::error_code ec;
    // The output folders can be written (a probe file of this rank's own): a run that cannot save its
    // checkpoints or metrics stops now, not after the model is built or at its first save.
    {
      namespace fs = std::filesystem;
      std::vector<std::pair<fs::path, std::string>> folders = {{fs::path(cfg_.job.dump_folder), "job.dump_folder"}};
      if (c.enable && !c.load_only) folders.emplace_back(fs::path(cfg_.job.dump_folder) / c.folder, "checkpoint.folder");
      for (const auto& [folder, key] : folders) {
        fs::create_directories(folder, ec);
        TITAN_USER_CHECK(!ec, "cannot create the folder ", folder.string(), " (", key, "): ", ec.message(),
                         ": choose a folder this process can write");
        const fs::path probe = folder / (".titan-write-check-" + std::to_string(::getpid()) + "-" + std::to_string(env_.rank));
        {
          std::ofstream out(probe);
          out << "ok";
          out.close();
          TITAN_USER_CHECK(out.good(), "cannot write in the folder ", folder.string(), " (", key,
                           "): choose a folder this process can write, on a disk with free space");
        }
        fs::remove(probe, ec);
      }
    }
    if (!c.initial_load_path.empty() &&
        checkpoint::list_checkpoints((std::filesystem::path(cfg_.job.dump_folder) / c.folder).string()).empty())
      TITAN_USER_CHECK(std::filesystem::exists(c.initial_load_path, ec), "checkpoint.initial_load_path '",
                       c.initial_load_path, "' does not exist: give a titan checkpoint's step folder, a torch.distributed.checkpoint step folder or a Hugging "
                       "Face model folder (config.json and safetensors)");
  }
}

// The weight gradient's float8 matmul sums over a rank's tokens of a micro-batch (under sequence
// parallelism a replicated layer's, 1/tp of them): CUDA's kernels need a multiple of 16.
void Trainer::check_float8_on_cuda() {
  const auto& tr = cfg_.training;
  if (float8_.recipe && device_.is_cuda() && !float8_.recipe->emulate) {
    // The weight gradient's float8 matmul sums over a rank's tokens of a micro-batch (under sequence
    // parallelism a replicated layer's, 1/tp of them): CUDA's kernels need a multiple of 16.
    const int64_t sequences = dims_->pp() > 1 ? cfg_.parallelism.pipeline_parallel_microbatch_size : tr.local_batch_size;
    int64_t tokens = sequences * tr.seq_len / dims_->cp();
    if (dims_->tp() > 1 && cfg_.parallelism.enable_sequence_parallel && !model_->moe_layers().empty()) tokens /= dims_->tp();
    TITAN_USER_CHECK(tokens % 16 == 0, "float8 linear layers on CUDA multiply over each rank's ", tokens,
                     " tokens per micro-batch, which float8 matmuls need a multiple of 16 of: choose training.seq_len "
                     "or the batch so that they are, or set quantize.linear.float8.emulate");
  }
}

// Every parameter this rank holds (FSDP shards, TP shards, whole), in the optimizer's order, with the
// MoE layers and the shared (tied) parameters' positions.
std::vector<std::pair<std::string, at::Tensor>> Trainer::collect_parameters() {
  std::vector<std::pair<std::string, at::Tensor>> named;
  if (dims_->pp() > 1) {
    for (const LanguageModel& stage : stage_models_)
      for (auto& layer : stage->moe_layers()) moe_layers_.push_back(layer);
  } else {
    moe_layers_ = model_->moe_layers();
  }
  moe_model_ = !model_->moe_layers().empty();  // the whole model's (a pipeline stage may hold none)
  for (auto& [prefix, layer] : moe_layers_) layer->force_load_balance = cfg_.debug.moe_force_load_balance;
  if (cfg_.debug.moe_force_load_balance)
    log_warning(moe_model_ ? "debug.moe_force_load_balance: MoE tokens are routed round-robin over the experts, "
                             "whatever the routers say (a speed measurement under perfect balance, not training)"
                           : "debug.moe_force_load_balance has no effect: the model has no MoE layers");
  for (const auto& dp : data_parallel_) {
    params_.insert(params_.end(), dp->parameters().begin(), dp->parameters().end());
    for (auto& p : dp->named_parameters()) named.push_back(std::move(p));
  }
  for (SharedGradient& s : shared_gradients_) {
    const auto it = std::find_if(params_.begin(), params_.end(), [&](const dist::PlacedTensor& p) { return p.name == s.name; });
    TITAN_ASSERT(it != params_.end(), "shared parameter ", s.name, " is not among this rank's parameters");
    s.param = static_cast<size_t>(it - params_.begin());
  }
  if (!shared_gradients_.empty())
    for (const auto& p : params_)
      if (!is_shared_copy(p.name)) norm_params_.push_back(p);
  return named;
}

void Trainer::log_run(double model_seconds, int64_t global_batch, bool float8_all_gather, int64_t float8_gathered) {
  const auto& tr = cfg_.training;
  log_info("Parallelism: " + dims_->describe() +
           (data_parallel_[0]->kind() != "none" ? " (" + data_parallel_[0]->kind() + ")" : "") +
           (tensor_parallel_ ? std::string(" (TP") + (tensor_parallel_->options().sequence_parallel ? ", sequence parallel" : "") +
                                   (tensor_parallel_->options().loss_parallel ? ", loss parallel" : "") +
                                   (tensor_parallel_->options().async ? ", async" : "") + ")"
                             : "") +
           (context_parallel_ ? std::string(" (CP: ring attention, ") +
                                    (context_parallel_->options().load_balance ? "headtail load balancing" : "contiguous chunks") +
                                    ", K/V by " + context_parallel_->options().rotate + ")"
                              : "") +
           (expert_parallel_ ? " (EP: routed experts split over " + std::to_string(dims_->ep()) +
                                   " ranks, tokens exchanged by all-to-all; experts sharded by FSDP over " +
                                   std::to_string(dims_->degree("efsdp")) + ")"
                             : "") +
           (tr.enable_cpu_offload ? "; parameters, gradients and optimizer state offloaded to CPU memory" : ""));
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "Model %s %s: %s parameters, %.3e training FLOPs per token; device %s%s; built, initialized and "
                "sharded in %.2f s",
                cfg_.model.name.c_str(), cfg_.model.flavor.c_str(),
                metrics::format_thousands(model_->num_params()).c_str(), model_->flops_per_token(tr.seq_len),
                device_.str().c_str(), bf16_autocast_ ? ", bf16 autocast" : "", model_seconds);
  log_info(buf);
  if (float8_.recipe || float8_.grouped_recipe) log_info(describe(float8_));
  if (float8_all_gather) {
    if (float8_gathered > 0) {
      log_info("float8 all-gather: FSDP gathers " + std::to_string(float8_gathered) + " float8 weights in float8 (" +
               (precompute_float8_scales_ ? "scales precomputed after each optimizer step with one all-reduce"
                                          : "scales from an all-reduce of their amaxes at each unit's first gather of a micro-batch") + ")");
    } else {
      log_warning("quantize.linear.float8.enable_fsdp_float8_all_gather has no effect: no FSDP unit holds a "
               "float8 layer in this layout (FSDP shards over data_parallel_shard_degree x context_parallel_degree "
               "> 1 ranks, or with training.enable_cpu_offload)");
    }
  }
  if (cfg_.model.print_after_conversion) log_info("Model after conversion:\n" + model_description(*model_));
  const auto& ac = cfg_.activation_checkpoint;
  log_info("Activation checkpointing: " +
           (ac.mode == "memory_budget"          ? ac_plan_words_
            : ac.mode == "none"                 ? std::string("off")
            : ac.mode == "full"                 ? std::string("every block")
            : ac.selective_ac_option == "op"
                ? std::string(ac.per_op_policy == "all_matmuls"
                                  ? "per operator (attention and every matmul output kept)"
                                  : "per operator (attention and every other matmul output kept)")
                                                : "1 block in " + ac.selective_ac_option));
  log_info("Data: " + dataloader_->description());
  log_info("Training " + std::to_string(tr.steps) + " steps: local batch " + std::to_string(tr.local_batch_size) +
           ", global batch " + std::to_string(global_batch) + ", gradient accumulation steps " +
           std::to_string(grad_accum_steps_) + ", sequence length " + std::to_string(tr.seq_len));
}

at::Tensor Trainer::loss_of(const at::Tensor& logits_BSV, const at::Tensor& labels_BS, int64_t step,
                            double global_tokens) {
  // Chunked: no fp32 copy of the whole batch's logits, no fp32 log-softmax saved (docs/memory.md).
  // Under loss parallel the logits are this rank's vocabulary slice (the loss combines them).
  at::Tensor loss = parallelized_.loss_sum(logits_BSV.flatten(0, 1), labels_BS.flatten(0, 1)) / global_tokens;
  fault::point("loss", step);
  if (fault::nan_loss(step)) loss = loss * std::numeric_limits<float>::quiet_NaN();
  return loss;
}

at::Tensor Trainer::forward_backward(int64_t step, double global_tokens) {
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().device(device_).dtype(at::kFloat));
  for (int64_t micro = 0; micro < grad_accum_steps_; ++micro) {
    const data::Batch batch = next_batch(step);
    at::Tensor loss;
    {
      TraceRange range(mem::Phase::Forward, "forward");
      CudaBf16Autocast autocast(bf16_autocast_);
      at::Tensor logits_BSV = model_->forward(batch.inputs);
      fault::point("forward", step);
      if (fault::enabled())
        logits_BSV.register_hook([step](const at::Tensor& g) {
          fault::point("backward", step);  // backward has begun; the model's gradients have not
          return g;
        });
      loss = loss_of(logits_BSV, batch.labels, step, global_tokens);
    }
    const bool last = micro == grad_accum_steps_ - 1;  // its backward completes the reductions
    if (early_step_ && last) {
      const at::Tensor bad_loss = at::logical_not(at::isfinite(loss_sum + loss.detach()));
      early_skip_ = stopped_.defined() ? at::logical_or(stopped_, bad_loss) : bad_loss;
    }
    {
      TraceRange range(mem::Phase::Backward, "backward");
      data_parallel_[0]->before_backward(last);
      loss.backward();
      data_parallel_[0]->after_backward(last);
    }
    loss_sum += loss.detach();
    ntokens_seen_ += batch.labels.numel() * dims_->cp();  // the whole sequences
  }
  return loss_sum;
}

data::Batch Trainer::next_batch(int64_t step) {
  fault::point("data", step);
  const auto t0 = Clock::now();
  TraceRange range(mem::Phase::Data, "data_loading");
  data::Batch batch = dataloader_->next();
  if (context_parallel_) {
    batch.inputs = context_parallel_->shard(batch.inputs, 1);
    batch.labels = context_parallel_->shard(batch.labels, 1);
  }
  to_device(batch);
  data_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
  return batch;
}

void Trainer::to_device(data::Batch& batch) const {
  for (at::Tensor* t : {&batch.inputs, &batch.labels}) {
    // On CUDA from pinned memory, asynchronously: a copy from pageable memory would wait for the
    // device to finish the work already queued (the previous step's), leaving it idle while this
    // step starts. The caching host allocator reuses a pinned block only once its copy has completed.
    *t = device_.is_cuda() ? t->pin_memory().to(device_, t->scalar_type(), /*non_blocking=*/true) : t->to(device_);
  }
}

Trainer::StepOnDevice Trainer::run_step() {
  const auto& tr = cfg_.training;
  optimizer_->zero_grad();
  StepOnDevice r;
  r.lr = cfg_.optimizer.lr * lr_schedule_->factor(lr_step_);
  optimizer_->set_lr(r.lr);

  // Every micro-batch's loss is a sum over its tokens divided by the tokens of the whole global
  // batch (all micro-batches of all data-parallel ranks), so the gradients summed over
  // micro-batches and ranks equal the gradient of the big-batch mean loss.
  const double local_tokens = static_cast<double>(grad_accum_steps_ * tr.local_batch_size * tr.seq_len);
  const double global_tokens = local_tokens * static_cast<double>(dims_->dp_size());
  const int64_t step = step_ + 1;  // the step this call computes (1-based)
  at::Tensor loss_sum = pipeline_ ? pipeline_forward_backward(step, global_tokens) : forward_backward(step, global_tokens);
  std::optional<TraceRange> optimizer_range;  // clipping, the loss's reductions and the update
  optimizer_range.emplace(mem::Phase::Optimizer, "optimizer");
  // The global norm: sharded gradients add their squares over the groups their placements name. A
  // non-finite local loss makes it infinite wherever this rank's gradient sums are reduced (tensor
  // parallel and FSDP peers); the loss itself is then reduced over the data-parallel ranks.
  // Under pipeline parallelism the loss is the last stage's: summed over the stages first, so that
  // every rank logs the global loss; each stage's gradients add their squares over the stages.
  if (pipeline_) (*mesh_)["pp"].all_reduce(loss_sum).wait();
  // Under context parallelism each rank's loss covers its part of the sequences: summed over cp
  // first, it is the data-parallel rank's loss.
  if (context_parallel_) (*mesh_)["cp"].all_reduce(loss_sum).wait();
  const at::Tensor bad_loss = at::where(at::isfinite(loss_sum), 0.0, std::numeric_limits<double>::infinity());
  // A copy of a parameter shared between pipeline stages (tied embeddings) counts once in the norm,
  // on the primary copy's stage (norm_params_), and is clipped like the others (so the copies stay
  // equal): the optimizer divides every gradient it steps.
  at::Tensor grad_norm, clip_divisor;
  if (early_step_) {  // the gradients are gone (and not clipped: max_norm has no effect): the norm from theirs
    grad_norm = dist::grad_norm_of(params_, early_norms_, *mesh_, bad_loss);
    std::fill(early_norms_.begin(), early_norms_.end(), at::Tensor());
  } else {
    // Clipping is applied by the optimizer as it reads the gradients, not by a pass of its own.
    std::tie(grad_norm, clip_divisor) =
        dist::grad_norm_and_clip_divisor(shared_gradients_.empty() ? params_ : norm_params_, tr.max_norm, *mesh_,
                                         bad_loss, pipeline_ ? std::vector<std::string>{"pp"} : std::vector<std::string>{});
  }
  // Global average loss (sum over ranks) and the largest local average.
  at::Tensor local_avg = loss_sum * (global_tokens / local_tokens);
  (*mesh_)["dp"].all_reduce(loss_sum).wait();
  (*mesh_)["dp"].all_reduce(local_avg, c10d::ReduceOp::MAX).wait();
  // A non-finite loss or gradient norm (so decided alike on every rank) never updates the model.
  // Decided on the device: the optimizer's kernels read the flag, no host synchronization. Under
  // nan_policy stop the flag sticks, so that no update follows a bad step before the host reads it
  // (at the next log, save or validation step) and stops the run.
  at::Tensor nonfinite = at::logical_not(at::isfinite(grad_norm.to(loss_sum.device())) & at::isfinite(loss_sum));
  if (tr.nan_policy == "stop") {
    stopped_ = stopped_.defined() ? at::logical_or(stopped_, nonfinite) : nonfinite;
    nonfinite = stopped_;
  }
  fault::point("optimizer", step);
  if (early_step_)
    optimizer_->end_step();  // every parameter was updated in backward
  else
    optimizer_->step(nonfinite.to(at::kFloat), clip_divisor);
  if (precompute_float8_scales_)  // the next step's float8 all-gathers cast with these scales
    for (const auto& dp : data_parallel_)
      if (dp->fsdp()) dp->fsdp()->precompute_float8_scales();
  const at::Tensor moe_load = update_expert_biases(nonfinite);
  optimizer_range.reset();
  ++step_;
  ++lr_step_;
  std::vector<at::Tensor> values = {loss_sum.to(at::kDouble), local_avg.to(loss_sum.device(), at::kDouble),
                                    grad_norm.to(loss_sum.device(), at::kDouble), nonfinite.to(at::kDouble)};
  if (moe_load.defined())
    for (const at::Tensor& v : moe_load.to(loss_sum.device(), at::kDouble).unbind()) values.push_back(v);
  r.values = at::stack(values);
  return r;
}

void Trainer::set_up_early_step() {
  // (config validation refused what cannot step in backward: nan_policy skip, pipeline and expert
  // parallelism; clipping is off, with a warning)
  TITAN_ASSERT(data_parallel_.size() == 1 && !pipeline_, "early_step_in_backward with pipeline parallelism");
  early_step_ = true;
  optimizer_->create_state();  // not in the first backward, beside its activations
  log_warning("optimizer.early_step_in_backward: every parameter is updated inside the backward as soon as its "
              "gradient is final, and the gradient freed; gradients are not clipped (training.max_norm has no "
              "effect: the global norm is known only after every update); the logged grad_norm is the norm of the "
              "gradients the updates used");
  early_norms_.assign(params_.size(), at::Tensor());
  std::unordered_map<const void*, size_t> index;
  for (size_t i = 0; i < params_.size(); ++i) index.emplace(params_[i].local.unsafeGetTensorImpl(), i);
  data_parallel_.front()->step_in_backward([this, index = std::move(index)](const std::vector<at::Tensor>& params) {
    std::vector<at::Tensor> stepped, grads;
    for (const at::Tensor& p : params)
      if (p.grad().defined()) {
        stepped.push_back(p);
        grads.push_back(p.grad());
      }
    if (stepped.empty()) return;
    // Norms as the gradient norm takes them (fp64), kept for it; one non-finite one skips the lot.
    const std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2, at::kDouble);
    for (size_t k = 0; k < stepped.size(); ++k) early_norms_[index.at(stepped[k].unsafeGetTensorImpl())] = norms[k];
    const at::Tensor bad_norm = at::logical_not(at::isfinite(at::stack(norms).sum()));
    const at::Tensor skip = early_skip_.defined() ? at::logical_or(early_skip_.to(bad_norm.device()), bad_norm) : bad_norm;
    optimizer_->step_parameters(stepped, skip.to(at::kFloat));
  });
}

void Trainer::set_moe_load(metrics::StepStats& s, const StepResult& r) {
  // (sum of the layers' imbalances, layers, largest) of this rank's layers; under pipeline
  // parallelism every stage holds its own, gathered on log steps (every rank logs at the same steps).
  std::array<double, 4> load = r.moe_load;
  if (dims_->pp() > 1) {
    dist::Group& pp = (*mesh_)["pp"];
    at::Tensor mine = at::tensor(std::vector<double>(load.begin(), load.end()), at::kDouble).to(mesh_->device());
    at::Tensor all = at::empty({pp.size() * 4}, mine.options());
    pp.all_gather(all, mine).wait();
    const at::Tensor host = all.view({pp.size(), 4}).to(at::kCPU);
    load = {host.select(1, 0).sum().item<double>(), host.select(1, 1).sum().item<double>(),
            host.select(1, 2).max().item<double>(), host.select(1, 3).sum().item<double>()};
  }
  if (load[1] > 0) {
    s.moe_imbalance = load[0] / load[1];
    s.moe_imbalance_max = load[2];
  }
  if (moe_aux_loss_coeff_ > 0) s.moe_aux_loss = load[3] * moe_aux_loss_scale_;
}

void Trainer::set_up_moe_aux_loss() {
  // (model_: the whole model, whatever this rank holds)
  moe_aux_loss_coeff_ = moe_aux_loss_coeff(cfg_.model.moe_aux_loss_coeff, *model_, cfg_.model.name, cfg_.model.flavor);
  if (moe_aux_loss_coeff_ == 0) return;
  const auto all = model_->moe_layers();
  // Each micro-batch's forward balances over its own tokens on every data-parallel rank; the step's
  // auxiliary loss is the mean over the MoE layers and the micro-batches.
  const int64_t micro = grad_accum_steps_ * (pipeline_ ? pipeline_->microbatches() : 1);
  moe_aux_loss_scale_ = 1.0 / static_cast<double>(static_cast<int64_t>(all.size()) * micro);
  for (const auto& [prefix, layer] : moe_layers_) {
    layer->aux_loss_weight = moe_aux_loss_coeff_ * moe_aux_loss_scale_;
    layer->global_counts = dist::routing_counts_sum((*mesh_)["dp_cp"], sequence_parallel_tp());
  }
}

dist::Group* Trainer::sequence_parallel_tp() {
  return tensor_parallel_ && tensor_parallel_->options().sequence_parallel ? &(*mesh_)["tp"] : nullptr;
}

at::Tensor Trainer::update_expert_biases(const at::Tensor& skipped) {
  if (moe_layers_.empty()) return moe_model_ ? at::zeros({4}, at::TensorOptions().device(device_)) : at::Tensor();
  at::NoGradGuard no_grad;
  // Per layer its counts (E) and, with the auxiliary loss, its terms: one collective for every layer.
  const bool aux = moe_aux_loss_coeff_ > 0;
  std::vector<at::Tensor> rows;
  for (const auto& [prefix, layer] : moe_layers_) {
    const at::Tensor& c = layer->tokens_per_expert;
    if (!aux) {
      rows.push_back(c);
      continue;
    }
    const at::Tensor terms = layer->aux_loss_terms.defined() ? layer->aux_loss_terms.to(c.device(), c.scalar_type())
                                                             : at::zeros({}, c.options());
    rows.push_back(at::cat({c, terms.reshape({1})}));
  }
  at::Tensor all = at::stack(rows);
  dist::sum_routing_figures(all, (*mesh_)["dp_cp"], sequence_parallel_tp());
  const int64_t E = moe_layers_.front().second->options().num_experts;
  const at::Tensor all_LE = all.narrow(1, 0, E);
  const at::Tensor aux_sum = aux ? all.select(1, E).sum() : at::zeros({}, all.options());
  // Each layer's load imbalance: its busiest expert's routed copies over the mean (1 when balanced).
  const at::Tensor imbalance_L = std::get<0>(all_LE.max(1)) / all_LE.mean(1).clamp_min(1e-9);
  const at::Tensor load = at::stack({imbalance_L.sum(), at::full({}, static_cast<double>(moe_layers_.size()), imbalance_L.options()),
                                     imbalance_L.max(), aux_sum});
  for (size_t i = 0; i < moe_layers_.size(); ++i) {
    nn::MoEImpl& layer = *moe_layers_[i].second;
    layer.aux_loss_terms = at::Tensor();
    if (layer.expert_bias.defined()) {
      at::Tensor updated = layer.expert_bias.clone();
      nn::update_expert_bias(updated, all_LE[static_cast<int64_t>(i)], layer.options().load_balance_coeff);
      layer.expert_bias.copy_(at::where(skipped.to(updated.device()), layer.expert_bias, updated));
    }
    layer.tokens_per_expert.zero_();
  }
  return load;
}

std::vector<StepResult> Trainer::read_steps(const std::vector<StepOnDevice>& steps) {
  std::vector<StepResult> out;
  if (steps.empty()) return out;
  std::vector<at::Tensor> all;
  for (const auto& s : steps) all.push_back(s.values);
  const at::Tensor host = at::stack(all).to(at::kCPU);  // (steps, 4 or 7): the one host read
  const auto v = host.accessor<double, 2>();
  for (size_t i = 0; i < steps.size(); ++i) {
    StepResult r;
    r.lr = steps[i].lr;
    r.loss = v[i][0];
    r.max_loss = v[i][1];
    r.grad_norm = v[i][2];
    r.skipped = v[i][3] != 0;
    if (host.size(1) == 8) r.moe_load = {v[i][4], v[i][5], v[i][6], v[i][7]};
    out.push_back(r);
  }
  return out;
}

StepResult Trainer::train_step() { return read_steps({run_step()}).at(0); }

std::vector<double> Trainer::train() {
  std::vector<double> losses;
  const auto& tr = cfg_.training;
  auto interval_start = Clock::now();
  int64_t tokens_at_last_log = ntokens_seen_, step_at_last_log = step_;  // after a resume too
  // Results stay on the device until a step needs them on the host: a log line, a save (never of a
  // state after a bad step), a validation, the last step.
  std::vector<StepOnDevice> unread;
  int64_t first_unread = step_ + 1;
  std::optional<HostReadCounter> host_reads;  // only with TITAN_DEBUG_DUMP_COMM
  if (std::getenv("TITAN_DEBUG_DUMP_COMM")) {
    host_reads.emplace();
    host_reads_outside_log_steps_ = 0;
  }
  // A preemption signal received during start-up stops the run before its first step.
  if (preemption_ && step_ < tr.steps)
    if (const int sig = preemption_vote(/*blocking=*/true, /*issue_next=*/true)) stop_for_preemption(sig, false);
  while (step_ < tr.steps) {
    const int64_t reads_before = host_reads ? host_reads->count() : 0;
    if (checkpointer_) checkpointer_->check();  // a failed background save stops the run
    if (profiler_) profiler_->step_begin(step_ + 1);
    try {
      unread.push_back(run_step());
    } catch (const c10::OutOfMemoryError& e) {
      throw_out_of_memory(e, step_ + 1);
    }
    if (profiler_) {  // the peak breakdown of this step's window, before the log resets it
      const auto snapshot_start = Clock::now();
      profiler_->snapshot_step(step_);
      interval_start += Clock::now() - snapshot_start;
    }
    // The first step may wait long (start-up of every rank, first allocations, a slow first data
    // read): collectives get comm.init_timeout_seconds until it is done, then train_timeout_seconds.
    if (!timeout_set_) {
      mesh_->set_timeout(std::chrono::seconds(cfg_.comm.train_timeout_seconds), "comm.train_timeout_seconds");
      // The data exchanges of text tokenized together wait as long as training's collectives.
      for (dist::Group* g : data_groups_) g->set_timeout(std::chrono::seconds(cfg_.comm.train_timeout_seconds), "comm.train_timeout_seconds");
      timeout_set_ = true;
    }
    // Every rank stops after the same step: the one at which the vote finds a preemption signal (the
    // last step ends the run anyway).
    const int preempted = preemption_ ? preemption_vote(false, /*issue_next=*/step_ < tr.steps) : 0;
    const bool stop = preempted != 0 && step_ < tr.steps;
    const bool log = metrics_->should_log(step_) || stop;
    const bool save = checkpointer_ && checkpointer_->should_save(step_, tr.steps);
    const bool validate_now = val_loader_ && (step_ == 1 || step_ % cfg_.validation.freq == 0);
    const bool read = log || save || validate_now || step_ == tr.steps;
    StepResult r;
    if (read) {
      const std::vector<StepResult> results = read_steps(unread);
      unread.clear();
      for (size_t i = 0; i < results.size(); ++i) {
        losses.push_back(results[i].loss);
        if (results[i].skipped) on_nonfinite_step(results[i], first_unread + static_cast<int64_t>(i));
      }
      first_unread = step_ + 1;
      r = results.back();
    }
    metrics_->on_step(step_);
    if (log) {
      if (device_.is_cuda()) torch::cuda::synchronize();
      metrics::StepStats s;
      s.step = step_;
      s.loss = r.loss;
      s.max_loss = r.max_loss;
      s.grad_norm = r.grad_norm;
      s.lr = r.lr;
      s.tokens_since_last_log = ntokens_seen_ - tokens_at_last_log;
      s.seconds_since_last_log = std::chrono::duration<double>(Clock::now() - interval_start).count();
      s.steps_since_last_log = step_ - step_at_last_log;
      s.flops_per_token = model_->flops_per_token(tr.seq_len);
      s.ntokens_seen = tokens_seen();
      s.data_loading_seconds = data_seconds_;
      if (moe_model_) set_moe_load(s, r);
      s.data_source_tokens = dataloader_->tokens_by_source();
      metrics_->log(s);
      interval_start = Clock::now();
      tokens_at_last_log = ntokens_seen_;
      step_at_last_log = step_;
      data_seconds_ = 0;
    }
    // torchtitan's rule: at step 1 and every validation.freq steps. Its time is not the training's.
    if (validate_now) {
      const auto validation_start = Clock::now();
      TraceRange range(mem::Phase::Validation, "validation");
      try {
        metrics_->log_validation(validate());
      } catch (const c10::OutOfMemoryError& e) {
        throw_out_of_memory(e, step_, OutOfMemoryAt::Validation);
      }
      interval_start += Clock::now() - validation_start;
    }
    if (profiler_) {  // a recorded window ends after the step's evaluation; writing it is not training time
      const auto profiler_start = Clock::now();
      profiler_->step_end(step_);
      interval_start += Clock::now() - profiler_start;
    }
    if (save) save_checkpoint_at_step();
    if (step_callback_) step_callback_(step_);
    if (host_reads && !read) host_reads_outside_log_steps_ += host_reads->count() - reads_before;
    if (stop) stop_for_preemption(preempted, save);
  }
  if (profiler_) profiler_->finish(step_);
  if (checkpointer_) checkpointer_->wait();
  log_info("Training completed");
  // Debugging aid (docs/parallelism.md): what each mesh dimension moved during the run, per rank.
  if (const char* prefix = std::getenv("TITAN_DEBUG_DUMP_COMM")) {
    nlohmann::json j = {{"rank", env_.rank}, {"steps", step_}, {"bytes", mesh_->bytes()}, {"calls", mesh_->calls()},
                        {"host_reads_outside_log_steps", host_reads_outside_log_steps_}};
    if (pipeline_) j["pipeline_weight_pass_fallbacks"] = pipeline_->weight_pass_fallbacks();
    std::ofstream(std::string(prefix) + ".rank" + std::to_string(env_.rank) + ".json") << j.dump(1) << "\n";
  }
  // Debugging aid (docs/parallelism.md): the trained weights and per-step losses, to compare layouts.
  if (const char* path = std::getenv("TITAN_DEBUG_DUMP_WEIGHTS")) {
    auto params = full_parameters();
    if (env_.rank == 0) {
      params["__losses__"] = at::tensor(losses, at::kDouble);
      safetensors::save(path, params);
    }
  }
  return losses;
}

int Trainer::preemption_vote(bool blocking, bool issue_next) {
  PreemptionVoter& voter = *preemption_voter_;
  int found = voter.pending() ? voter.read() : 0;
  if (found == 0 && issue_next) {
    voter.issue(PreemptionHandler::requested());
    if (blocking) found = voter.read();
  }
  return found;
}

void Trainer::stop_for_preemption(int sig, bool saved_now) {
  const std::string what = "Preemption: " + signal_display_name(sig) + " received";
  const std::string code = "; exiting with code " + std::to_string(kExitPreempted);
  if (step_ == 0) {
    log_info(what + " before the first step: nothing to save" + code);
    throw Preempted(what);
  }
  if (checkpointer_ && !saved_now && checkpointer_->latest_step() == step_) {  // e.g. just resumed from it
    log_info(what + " at step " + std::to_string(step_) + ", saved already in " + checkpointer_->step_dir(step_) + code);
    throw Preempted(what);
  }
  if (!checkpointer_ || cfg_.checkpoint.load_only) {
    log_info(what + "; stopped after step " + std::to_string(step_) + " without a checkpoint (" +
             (checkpointer_ ? "checkpoint.load_only" : "checkpoint.enable is false") +
             "): the steps of this run are lost" + code);
    throw Preempted(what);
  }
  log_info(what + "; stopped after step " + std::to_string(step_) + ", saving its checkpoint");
  if (!saved_now) save_checkpoint(/*model_only=*/false);
  checkpointer_->wait();  // synchronous: complete on every rank before the process exits
  log_info(what + ": saved step " + std::to_string(step_) + " in " + checkpointer_->step_dir(step_) + code +
           "; run the same command again to resume from it");
  throw Preempted(what);
}

void Trainer::throw_out_of_memory(const c10::OutOfMemoryError& e, int64_t step, OutOfMemoryAt where) {
  const std::string path = profiler_ ? profiler_->write_oom_snapshot(step) : "";
  std::string advice = path.empty() ? "set profiling.enable_memory_snapshot = true for a memory snapshot at the failure"
                                    : std::string("memory snapshot: ") + path +
                                          (device_.is_cuda() ? " (open it at https://pytorch.org/memory_viz)" : "");
  const std::string when = where == OutOfMemoryAt::Validation ? "in the validation after step " + std::to_string(step)
                                                               : "at step " + std::to_string(step);
  throw UserError(out_of_memory_message(cfg_, when, e, where) + "\n  " + advice);
}

std::string out_of_memory_message(const JobConfig& cfg, const std::string& when, const c10::OutOfMemoryError& e,
                                  OutOfMemoryAt where) {
  const std::string what = e.what_without_backtrace();
  std::string out = "out of memory " + when + ": ";
  const std::optional<mem::AllocationFailure> cpu = mem::last_cpu_allocation_failure();
  if (cpu && what.rfind("CPU out of memory", 0) == 0) {
    auto format_bytes = [](int64_t b) {
      char text[32];
      const double mib = static_cast<double>(b) / (1024.0 * 1024.0);
      if (mib < 1024) std::snprintf(text, sizeof text, "%.1f MiB", mib);
      else std::snprintf(text, sizeof text, "%.2f GiB", mib / 1024);
      return std::string(text);
    };
    char buf[256];
    std::snprintf(buf, sizeof buf, "a CPU tensor of %s during %s did not fit, with %s of CPU tensors already allocated",
                  format_bytes(cpu->bytes).c_str(), mem::phase_name(cpu->phase), format_bytes(cpu->alive_bytes).c_str());
    out += buf;
  } else {
    out += what.substr(0, what.find('\n'));
  }
  const auto& ac = cfg.activation_checkpoint;
  out += "\n  to fit: ";
  if (where == OutOfMemoryAt::StartUp) {  // the parameters (and their optimizer states to come) do not fit
    out += "shard the model over more ranks (FSDP, TP, PP)";
    if (!cfg.training.enable_cpu_offload) out += ", offload it to CPU memory (training.enable_cpu_offload)";
    out += " or choose a smaller model.flavor";
  } else if (where == OutOfMemoryAt::Validation) {  // training's steps fit: the evaluation's batch does not
    out += "a smaller validation.local_batch_size (now " + std::to_string(cfg.validation.local_batch_size) +
           ") or validation.seq_len (now " + std::to_string(cfg.validation.seq_len) +
           "), or validation.enable = false; the training steps themselves fit";
  } else {
    if (ac.mode == "memory_budget" && ac.memory_budget > 0) {
      char budget[64];
      std::snprintf(budget, sizeof budget, "%g", ac.memory_budget);
      out += std::string("a lower activation_checkpoint.memory_budget (now ") + budget + "; 0 recomputes every block), ";
    } else if (ac.mode != "full") {
      out += "activation_checkpoint.mode = \"full\" (now \"" + ac.mode + "\"), ";
    }
    out += "a smaller training.local_batch_size (training.global_batch_size keeps the global batch by gradient "
           "accumulation), a shorter training.seq_len, or more ranks to shard over (FSDP, TP, PP)";
  }
  out += "; `titan estimate` with the same options gives the per-rank peak";
  if (cfg.debug.skip_memory_check) out += "\n  the pre-flight memory check was skipped (debug.skip_memory_check)";
  return out;
}

void Trainer::on_nonfinite_step(const StepResult& r, int64_t step) {
  ++skipped_steps_;
  char what[160];
  std::snprintf(what, sizeof what, "step %lld: the loss is %g and the gradient norm %g (not finite), so the model "
                "was not updated", static_cast<long long>(step), r.loss, r.grad_norm);
  if (cfg_.training.nan_policy == "skip") {
    log_warning(std::string(what) + "; training goes on with the next batch (training.nan_policy = skip; " +
             std::to_string(skipped_steps_) + " step(s) skipped so far)");
    return;
  }
  std::string last_checkpoint = "no checkpoint was saved";
  if (checkpointer_) {
    checkpointer_->wait();  // a save of an earlier, good step completes
    if (auto s = checkpointer_->latest_step()) last_checkpoint = "the last checkpoint (step " + std::to_string(*s) + ", " +
                                                                 checkpointer_->step_dir(*s) + ") is intact";
  }
  throw RunStopped(std::string(what) + "; the run stops (training.nan_policy = stop) and " + last_checkpoint +
                  ". Lower optimizer.lr or raise lr_scheduler.warmup_steps, check the data around this step, or set "
                  "training.nan_policy = \"skip\" to skip such steps");
}

void set_memory_budget_planner(MemoryBudgetPlanner planner) { memory_budget_planner() = std::move(planner); }

int run_training(const JobConfig& cfg, const std::function<void()>& preflight) {
  std::optional<Trainer> started;
  try {
    started.emplace(cfg, preflight);
  } catch (const c10::OutOfMemoryError& e) {
    throw UserError(
        out_of_memory_message(cfg, "during start-up (building, initializing or loading the model)", e,
                              OutOfMemoryAt::StartUp));
  }
  Trainer& trainer = *started;
  if (cfg.checkpoint.create_seed_checkpoint) {
    trainer.save_checkpoint(/*model_only=*/true);  // step 0: the initialized model
    trainer.wait_for_checkpoint();
    return 0;
  }
  trainer.train();
  return 0;
}

}  // namespace titan
