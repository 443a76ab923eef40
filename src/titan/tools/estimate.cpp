#include "titan/tools/estimate.h"

#include "titan/common/error.h"
#include "titan/distributed/context_parallel.h"
#include "titan/distributed/options.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/models/common/decoder.h"
#include "titan/models/pipeline_split.h"
#include "titan/models/registry.h"
#include "titan/tools/dry_run.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <iomanip>
#include <mutex>
#include <set>
#include <sstream>

namespace titan {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return out;
}

std::string gib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / kGiB);
  return buf;
}

// Bytes in the unit that reads best: B, KiB, MiB or GiB.
std::string human(int64_t bytes) {
  char buf[64];
  const double b = static_cast<double>(bytes);
  if (bytes < 1024)
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(bytes));
  else if (b < 1024.0 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024);
  else if (b < kGiB)
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / (1024.0 * 1024));
  else
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / kGiB);
  return buf;
}

const char* dtype_name(at::ScalarType t) { return t == at::kBFloat16 ? "bfloat16" : "float32"; }

std::string ac_words(const std::string& mode, int64_t k) {
  if (mode == "none") return "none";
  if (mode == "full") return "full (every block)";
  if (mode == "op") return "selective per operator";
  if (mode == "op_all_matmuls") return "selective per operator, all matmuls kept";
  return "selective " + std::to_string(k) + " (1 block in " + std::to_string(k) + ")";
}

// Most (stage, microbatch) activations alive at once in one rank's order: a forward keeps its
// microbatch's activations until the backward that releases them (B, or W after I).
int most_in_flight(const std::vector<std::optional<dist::PipeAction>>& actions) {
  std::set<std::pair<int, int>> alive;
  int most = 0;
  for (const auto& a : actions) {
    if (!a) continue;
    if (a->op == dist::PipeOp::Forward) {
      alive.emplace(a->stage, a->microbatch);
      most = std::max(most, static_cast<int>(alive.size()));
    } else if (a->op != dist::PipeOp::BackwardInput) {
      alive.erase({a->stage, a->microbatch});
    }
  }
  return most;
}

// Training FLOPs per token of the modules `modules` (a pipeline stage's, or several): torchtitan's
// formula split by module: 6 x their parameters outside the token embedding, plus the attention
// term's share of their blocks (the whole model's term is the same for every block).
double flops_per_token_of(const LanguageModelImpl& model, const std::vector<std::string>& modules, int64_t seq_len) {
  // Parameters counted as active per token (a mixture of experts' routed experts by top_k / experts).
  double all = 0, embedding = 0, mine = 0;
  int64_t blocks = 0, my_blocks = 0;
  auto in = [&](const std::string& name) {
    for (const auto& m : modules)
      if (name.rfind(m + ".", 0) == 0) return true;
    return false;
  };
  for (const auto& p : model.named_parameters()) {
    const double n = static_cast<double>(p.value().numel()) * model.active_share(p.key());
    const bool embed = p.key().rfind("tok_embeddings.", 0) == 0;
    all += n;
    if (embed) embedding += n;
    if (in(p.key()) && !embed) mine += n;
  }
  for (const auto& m : model.named_children())
    if (m.key() == "layers") blocks = static_cast<int64_t>(m.value()->children().size());
  for (const auto& m : modules)
    if (m.rfind("layers.", 0) == 0) ++my_blocks;
  const double attention = model.flops_per_token(seq_len) - 6.0 * (all - embedding);
  return 6.0 * mine +
         (blocks > 0 ? attention * static_cast<double>(my_blocks) / static_cast<double>(blocks) : 0.0);
}

int64_t peak_of(const DryRunResult& r) { return std::max(r.peak, r.first_step_peak); }

// A block mode in words (memory_budget's plan).
const char* block_mode_words(const std::string& mode) {
  return mode == "full"             ? "checkpointed in full"
         : mode == "op"             ? "per operator"
         : mode == "op_all_matmuls" ? "per operator, all matmuls kept"
                                    : "not checkpointed";
}

// memory_budget's plans, by budget_plan_key (a process resolves one or two: the pre-flight check's
// and the trainer's are the same).
std::mutex& budget_plans_mutex() {
  static std::mutex m;
  return m;
}
std::map<std::string, MemoryBudgetPlan>& budget_plans() {
  static std::map<std::string, MemoryBudgetPlan> plans;
  return plans;
}
std::string budget_plan_key(const JobConfig& cfg, int64_t world, const std::string& device) {
  return to_toml(cfg) + "\n# world " + std::to_string(world) + " on " + device;
}

}  // namespace

std::vector<int64_t> memory_budget_upgrade_order(int64_t blocks) {
  // The van der Corput sequence (0, 1/2, 1/4, 3/4, 1/8, ...) scaled to the blocks, each block at its
  // first hit: every prefix is spread evenly, and the k blocks for k are those for k - 1 and one
  // more. (2^m >= blocks points put one in every block.)
  std::vector<int64_t> order;
  std::vector<bool> taken(static_cast<size_t>(std::max<int64_t>(blocks, 0)));
  for (uint64_t j = 0; static_cast<int64_t>(order.size()) < blocks; ++j) {
    double x = 0, f = 0.5;
    for (uint64_t v = j; v; v >>= 1, f /= 2)
      if (v & 1) x += f;
    const auto b = std::min<int64_t>(blocks - 1, static_cast<int64_t>(x * static_cast<double>(blocks)));
    if (!taken[b]) {
      taken[b] = true;
      order.push_back(b);
    }
  }
  return order;
}

MemoryBudgetPlan resolve_memory_budget(double budget, int64_t blocks,
                                       const std::function<int64_t(const std::vector<std::string>&)>& activations) {
  const std::vector<std::string> ladder = {"none", "op_all_matmuls", "op", "full"};
  auto uniform = [&](const std::string& mode) { return std::vector<std::string>(static_cast<size_t>(blocks), mode); };
  std::vector<int64_t> measured;
  for (const auto& mode : ladder) measured.push_back(activations(uniform(mode)));
  const double target = measured.back() + budget * static_cast<double>(measured.front() - measured.back());
  // The rung below the bound, skipping any that saves nothing over the one before it.
  size_t low = 0, high = 0;
  for (size_t i = 1; i < ladder.size(); ++i) {
    if (measured[i] >= measured[low]) continue;
    high = i;
    if (measured[i] <= target) break;
    low = i;
  }
  const std::vector<int64_t> order = memory_budget_upgrade_order(blocks);
  auto mixed = [&](int64_t k) {  // k blocks at ladder[high], the others at ladder[low]
    std::vector<std::string> modes = uniform(ladder[low]);
    for (int64_t i = 0; i < k; ++i) modes[order[i]] = ladder[high];
    return modes;
  };
  // The fewest: none of them is too many (measured[low] > target), all of them are enough
  // (measured[high] <= target); bisected on dry runs, since blocks and pipeline ranks differ in what
  // a block's mode saves there.
  int64_t k = 0;
  if (measured[low] > target && high != low) {
    int64_t too_few = 0, enough = blocks;
    while (enough - too_few > 1) {
      const int64_t mid = (too_few + enough) / 2;
      (activations(mixed(mid)) <= target ? enough : too_few) = mid;
    }
    k = enough;
  }
  MemoryBudgetPlan plan;
  plan.block_modes = mixed(k);
  std::map<std::string, int64_t> count;
  for (const auto& m : plan.block_modes) ++count[m];
  std::ostringstream os;
  os << "memory budget " << std::setprecision(15) << budget << " (";
  bool first = true;
  for (auto it = ladder.rbegin(); it != ladder.rend(); ++it) {
    if (!count.count(*it)) continue;
    os << (first ? "" : ", ") << count[*it] << (first ? " of " + std::to_string(blocks) + " blocks " : " ")
       << block_mode_words(*it);
    first = false;
  }
  os << ")";
  plan.words = os.str();
  return plan;
}

ModelEstimate estimate_model(const std::string& model, const std::string& flavor, int64_t seq_len) {
  const ModelSpec& spec = model_spec(model);
  LanguageModel m = spec.build(flavor, at::TensorOptions().device(at::kMeta).dtype(at::kFloat), seq_len);
  ModelEstimate e;
  e.model = model;
  e.flavor = flavor;
  e.seq_len = seq_len;
  e.params = m->num_params();
  for (const auto& p : m->parameters()) e.largest_param = std::max<int64_t>(e.largest_param, p.numel());
  e.flops_per_token = m->flops_per_token(seq_len);
  e.param_bytes = e.params * 4;
  e.grad_bytes = e.params * 4;
  e.optimizer_bytes = e.params * 8;
  return e;
}

Estimate estimate(const JobConfig& cfg, const EstimateOptions& options) {
  const auto& p = cfg.parallelism;
  const auto& tr = cfg.training;
  TITAN_USER_CHECK(options.device == "cuda" || options.device == "cpu", "--device '", options.device,
                   "' is not one of cuda, cpu");
  TITAN_USER_CHECK(options.device_memory_gib > 0, "--device-memory-gib must be positive");
  int64_t world = options.world_size;
  if (world <= 0) {
    world = p.data_parallel_replicate_degree * std::max<int64_t>(1, p.data_parallel_shard_degree) *
            p.context_parallel_degree * p.tensor_parallel_degree * p.pipeline_parallel_degree;
  }
  const dist::ParallelDims dims = dist::parallel_dims(p, world);
  check_supported(cfg, world);  // what titan train refuses, the estimate refuses with the same words

  // Precision and data parallelism, decided as Trainer::Trainer decides them.
  const bool cuda = options.device == "cuda";
  const at::ScalarType param_dtype = tr.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  const bool bf16_compute = cuda && tr.mixed_precision_param == "bfloat16" && param_dtype == at::kFloat;
  const bool use_fsdp = dims.fsdp_enabled() || tr.enable_cpu_offload;
  TITAN_USER_CHECK(!use_fsdp || param_dtype == at::kFloat, "training.dtype bfloat16 with FSDP",
                   tr.enable_cpu_offload ? " (CPU offload shards with FSDP)" : "",
                   dims.cp() > 1 ? " (context parallelism shards the parameters over dp_shard x cp with FSDP)" : "",
                   " is not supported; FSDP keeps fp32 shards (use float32)");
  const int64_t dp = dims.dp_size();
  const int64_t global_batch = tr.global_batch_size < 0 ? tr.local_batch_size * dp : tr.global_batch_size;
  TITAN_USER_CHECK(tr.local_batch_size >= 1 && global_batch % (tr.local_batch_size * dp) == 0,
                   "training.global_batch_size ", global_batch, " is not a multiple of local_batch_size ",
                   tr.local_batch_size, " x data-parallel degree ", dp);

  DryRunPlan plan;
  plan.model = cfg.model.name;
  plan.flavor = cfg.model.flavor;
  plan.seq_len = tr.seq_len;
  plan.local_batch_size = tr.local_batch_size;
  plan.grad_accum_steps = global_batch / (tr.local_batch_size * dp);
  plan.param_dtype = param_dtype;
  plan.mixed_dtype = bf16_compute ? at::kBFloat16 : at::kFloat;
  plan.cuda = cuda;
  plan.dp_replicate = dims.dp_replicate();
  plan.dp_shard = dims.dp_shard();
  plan.cp = dims.cp();
  plan.fsdp = use_fsdp;
  plan.tp = dims.tp();
  plan.ep = dims.ep();
  // Resolved (and refused for a dense model) as the trainer does, on a shapes-only build.
  const LanguageModel shapes =
      model_spec(cfg.model.name).build(cfg.model.flavor, at::TensorOptions().device(at::kMeta), tr.seq_len);
  plan.moe_aux_loss_coeff = moe_aux_loss_coeff(cfg.model.moe_aux_loss_coeff, *shapes, cfg.model.name, cfg.model.flavor);
  plan.float8 = float8_conversion(cfg, dims.tp());
  plan.float8_options = cfg.float8;
  dist::check_sequence_length(tr.seq_len, dims.tp(), p.enable_sequence_parallel);
  plan.tp_options = dist::tensor_parallel_options(p);
  if (dims.cp() > 1) {
    plan.cp_options = dist::context_parallel_options(p.context_parallel_load_balancer, p.context_parallel_rotate_method);
    dist::check_context_parallel_sequence(tr.seq_len, dims.cp(), plan.cp_options.load_balance, dims.tp(),
                                          dims.tp() > 1 && p.enable_sequence_parallel);
  }
  const ModelSpec& spec = model_spec(cfg.model.name);
  if (dims.pp() > 1) {
    plan.pp = dims.pp();
    plan.pipeline = plan_pipeline(spec, cfg.model.flavor, p, tr.local_batch_size);
  }
  plan.reshard_after_forward = p.fsdp_reshard_after_forward;
  ParallelizeContext ac;  // the trainer's mapping of [activation_checkpoint]
  set_activation_checkpointing(ac, cfg.activation_checkpoint);
  plan.ac_mode = ac.ac_mode;
  plan.ac_every = ac.ac_every;
  plan.ac_force_recompute = ac.ac_force_recompute;
  plan.moe_force_load_balance = cfg.debug.moe_force_load_balance;
  plan.optimizer = cfg.optimizer.name;
  plan.optimizer_implementation = cfg.optimizer.implementation;
  plan.max_norm = tr.max_norm;
  plan.early_step = cfg.optimizer.early_step_in_backward;
  // One dry run per pipeline rank (one without pipeline parallelism); the worst has the largest peak.
  auto dry_run_ranks = [](DryRunPlan pl) {
    std::vector<DryRunResult> out;
    for (pl.pp_rank = 0; pl.pp_rank < pl.pp; ++pl.pp_rank) out.push_back(dry_run(pl));
    return out;
  };
  std::string ac_described = ac_words(plan.ac_mode, plan.ac_every);
  if (plan.ac_mode == "memory_budget") {
    // Resolved once per config, world size and device: a run's pre-flight check and its trainer ask
    // for the same plan ((4 + about log2(blocks)) dry runs of every pipeline rank: about 1 s for an
    // 8B model, 9 s for 405B on TP 8; more with more pipeline ranks).
    std::lock_guard<std::mutex> lock(budget_plans_mutex());
    auto& resolved = budget_plans();
    const std::string key = budget_plan_key(cfg, world, options.device);
    auto it = resolved.find(key);
    if (it == resolved.end()) {
      const auto* decoder = dynamic_cast<const DecoderImpl*>(shapes.get());
      TITAN_USER_CHECK(decoder, "activation_checkpoint.mode 'memory_budget' needs a model made of decoder blocks; ",
                       cfg.model.name, " is not: choose another activation_checkpoint.mode");
      auto worst_activations = [&](const std::vector<std::string>& block_modes) {
        DryRunPlan pl = plan;
        pl.ac_mode = "per_block";
        pl.ac_block_modes = block_modes;
        int64_t most = 0;
        for (const DryRunResult& o : dry_run_ranks(pl)) most = std::max(most, o.end_of_forward - (o.params + o.optimizer + o.buffers));
        return most;
      };
      const MemoryBudgetPlan chosen = resolve_memory_budget(
          cfg.activation_checkpoint.memory_budget, static_cast<int64_t>(decoder->blocks().size()), worst_activations);
      if (resolved.size() >= 8) resolved.clear();
      it = resolved.emplace(key, chosen).first;
    }
    plan.ac_mode = "per_block";
    plan.ac_block_modes = it->second.block_modes;
    ac_described = it->second.words;
  }
  const std::vector<DryRunResult> ranks = dry_run_ranks(plan);
  size_t worst = 0;
  for (size_t i = 1; i < ranks.size(); ++i)
    if (peak_of(ranks[i]) > peak_of(ranks[worst])) worst = i;
  const DryRunResult& r = ranks[worst];

  Estimate e;
  e.model = estimate_model(cfg.model.name, cfg.model.flavor, tr.seq_len);
  e.world_size = world;
  e.degrees = dims.describe();
  e.shard_degree = use_fsdp ? dims.dp_shard() * dims.cp() : 1;
  e.layout = use_fsdp ? (dims.dp_replicate_enabled() ? "HSDP" : "FSDP") : dims.ddp_enabled() ? "DDP" : "single process";
  auto add_layout = [&](const std::string& part) { e.layout = (e.layout == "single process" ? "" : e.layout + " + ") + part; };
  if (dims.tp() > 1) add_layout("TP " + std::to_string(dims.tp()) + (p.enable_sequence_parallel ? " (sequence parallel)" : ""));
  if (dims.cp() > 1) add_layout("CP " + std::to_string(dims.cp()));
  if (dims.pp() > 1) add_layout("PP " + std::to_string(dims.pp()) + " (" + plan.pipeline.schedule + ")");
  if (dims.ep() > 1)
    add_layout("EP " + std::to_string(dims.ep()) + " (experts FSDP over " + std::to_string(dims.degree("efsdp")) +
               "; routing taken as balanced)");
  e.device = options.device;
  e.compute_dtype = dtype_name(bf16_compute ? at::kBFloat16 : param_dtype);
  if (plan.float8.recipe) e.compute_dtype += ", float8 linear layers (recipe " + plan.float8.recipe->name + ")";
  if (plan.float8.grouped_recipe) e.compute_dtype += ", float8 grouped matmuls of MoE experts (rowwise)";
  e.param_dtype = dtype_name(param_dtype);
  e.offload = tr.enable_cpu_offload;
  e.activation_checkpointing = ac_described;
  e.ac_block_modes = plan.ac_block_modes;
  e.local_batch_size = tr.local_batch_size;
  e.grad_accum_steps = plan.grad_accum_steps;

  e.params = r.params;
  e.grads = r.grads;
  e.optimizer = r.optimizer;
  e.fsdp = use_fsdp;
  e.early_step = cfg.optimizer.early_step_in_backward;
  e.buffers = r.buffers;
  e.ddp_buckets = r.ddp_buckets;
  const int64_t peak = peak_of(r);
  // (gradients are freed by the optimizer's zero_grad at each step's start: none alive in forward)
  const int64_t held = r.params + r.optimizer + r.buffers;
  e.activations = r.end_of_forward - held;
  e.backward = peak - r.end_of_forward;
  e.peak_device = peak;
  if (e.offload && cuda) {
    // The dry run keeps FSDP's shards, gradient shards and optimizer state on the device; offloaded,
    // they live in host memory. Each all-gather then first copies the unit's fp32 shard to a pooled
    // device buffer (the dry run has it already when it casts to bf16), and with gradient
    // accumulation a reduced gradient shard is copied to the host before it is added.
    e.host = r.params + r.grads + r.optimizer;
    int64_t staging = 0, largest = 0;
    std::set<int64_t> sizes(r.unit_shard_numel.begin(), r.unit_shard_numel.end());
    for (int64_t n : sizes) staging += n * 4;
    for (int64_t n : sizes) largest = std::max(largest, n * 4);
    if (plan.mixed_dtype != at::kFloat) staging = 0;
    if (plan.grad_accum_steps > 1) e.host += largest;
    e.peak_device = peak - (r.params + r.grads + r.optimizer) + staging;
    e.buffers += staging;
  }

  // Resume: the state as held (on the host when offloaded) and one block of the largest parameter, read
  // as the rank's piece of it (sharded over FSDP and TP; the rows a rank holds, rounded up).
  {
    const int64_t pieces = e.shard_degree * p.tensor_parallel_degree;
    const int64_t elem = c10::elementSize(plan.param_dtype);
    e.load_block = (e.model.largest_param + pieces - 1) / pieces * elem;
    const int64_t state = (e.offload && cuda) ? 0 : r.params + r.optimizer;
    e.load_peak = state + e.buffers + (cuda ? 0 : e.load_block);
  }

  // The same run under the other activation checkpointing modes (their device peaks; the worst
  // pipeline rank's).
  const int64_t k = plan.ac_mode == "selective" ? plan.ac_every : 2, offloaded = peak - e.peak_device;
  e.peak_by_ac[ac_described] = e.peak_device;
  const std::vector<std::pair<std::string, int64_t>> modes = {{"none", 1}, {"full", 1}, {"selective", k}};
  for (const auto& [mode, every] : modes) {
    const std::string words = ac_words(mode, every);
    if (!options.other_ac_modes || e.peak_by_ac.count(words)) continue;
    DryRunPlan other = plan;
    other.ac_mode = mode;
    other.ac_every = every;
    int64_t most = 0;
    for (const DryRunResult& o : dry_run_ranks(other)) most = std::max(most, peak_of(o));
    e.peak_by_ac[words] = most - offloaded;
  }

  // This rank's tokens per step; each computes 1/tp of their FLOPs (the tensor-parallel ranks share
  // every token), 1/cp (the context-parallel ranks share every sequence) and, under pipeline
  // parallelism, its stages' part.
  e.tokens_per_step = plan.grad_accum_steps * tr.local_batch_size * tr.seq_len;
  const double rank_tokens = static_cast<double>(e.tokens_per_step) / static_cast<double>(dims.tp() * dims.cp());
  e.flops_per_step = e.model.flops_per_token * rank_tokens;
  e.comm_bytes = r.bytes;
  e.comm_calls = r.calls;

  if (dims.cp() > 1) {
    e.cp = dims.cp();
    e.cp_split = plan.cp_options.load_balance ? "headtail" : "contiguous";
    e.cp_rotate = plan.cp_options.rotate;
  }
  if (dims.pp() > 1) {
    const PipelinePlan& pl = plan.pipeline;
    e.pp = dims.pp();
    e.schedule = pl.schedule;
    e.num_stages = static_cast<int>(pl.stage_modules.size());
    e.microbatches = pl.microbatches;
    e.microbatch_size = pl.microbatch_size;
    e.worst_pp_rank = static_cast<int>(worst);
    const LanguageModel whole = spec.build(cfg.model.flavor, at::TensorOptions().device(at::kMeta), tr.seq_len);
    for (size_t i = 0; i < ranks.size(); ++i) {
      Estimate::PipelineRank pr;
      pr.rank = static_cast<int>(i);
      pr.stages = ranks[i].stages;
      pr.in_flight = most_in_flight(pl.order.at(i));
      pr.params = ranks[i].params;
      pr.peak = peak_of(ranks[i]) - offloaded;
      pr.activations = ranks[i].end_of_forward - (ranks[i].params + ranks[i].optimizer + ranks[i].buffers);
      std::vector<std::string> modules;
      for (int s : pr.stages) modules.insert(modules.end(), pl.stage_modules[s].begin(), pl.stage_modules[s].end());
      pr.flops_per_step = flops_per_token_of(*whole, modules, tr.seq_len) * rank_tokens;
      pr.comm_bytes = ranks[i].bytes;
      pr.comm_calls = ranks[i].calls;
      e.pipeline_ranks.push_back(std::move(pr));
    }
    e.flops_per_step = e.pipeline_ranks[worst].flops_per_step;
  }
  e.capacity = static_cast<int64_t>(options.device_memory_gib * kGiB);
  e.fits = e.peak_device <= e.capacity;
  return e;
}

std::string format_estimate(const Estimate& e) {
  std::ostringstream os;
  char line[256];
  std::snprintf(line, sizeof line, "%.3e", e.model.flops_per_token);
  os << "model: " << e.model.model << " " << e.model.flavor << "\n"
     << "parameters: " << with_commas(e.model.params) << "; training FLOPs per token at seq_len " << e.model.seq_len
     << ": " << line << "\n";
  os << "layout: " << e.world_size << (e.world_size == 1 ? " rank" : " ranks") << " (" << e.degrees << "), " << e.layout;
  if (e.shard_degree > 1) os << " sharding over " << e.shard_degree << " ranks";
  if (e.offload) os << ", CPU offload";
  os << "; computing on " << e.device << " in " << e.compute_dtype << " (parameters " << e.param_dtype << ")\n";
  os << "batch per rank: " << e.local_batch_size << " x " << e.model.seq_len << " tokens, " << e.grad_accum_steps
     << " micro-batch" << (e.grad_accum_steps == 1 ? "" : "es") << " per step; activation checkpointing "
     << e.activation_checkpointing << "\n";
  if (e.cp > 1)
    os << "context parallel: each of the " << e.cp << " cp ranks holds " << e.model.seq_len / e.cp << " of every sequence's "
       << e.model.seq_len << " tokens (" << e.cp_split << " split); ring attention moves K/V by " << e.cp_rotate << "\n";
  if (e.pp > 1) {
    os << "pipeline: " << e.num_stages << " stages over " << e.pp << " ranks, schedule " << e.schedule << ", "
       << e.microbatches << " microbatch" << (e.microbatches == 1 ? "" : "es") << " of " << e.microbatch_size
       << " sequence" << (e.microbatch_size == 1 ? "" : "s") << " per batch; the figures below are pipeline rank "
       << e.worst_pp_rank << "'s (the largest peak)\n";
  }

  const bool host = e.host > 0;
  os << "memory per rank (" << (e.device == "cpu" ? "CPU" : "device") << (host ? "; offloaded state in host memory" : "")
     << "):\n";
  auto row = [&](const std::string& what, const std::string& amount, const std::string& note) {
    std::snprintf(line, sizeof line, "  %-18s %11s  %s\n", what.c_str(), amount.c_str(), note.c_str());
    os << line;
  };
  const std::string where = host ? ", host" : "";
  const std::string shards = e.shard_degree > 1 ? " (shards over " + std::to_string(e.shard_degree) + " ranks" + where + ")"
                             : host              ? " (host)"
                                                 : "";
  row("parameters", gib(e.params), std::string(e.fsdp ? "float32" : e.param_dtype) + shards);
  row("gradients", gib(e.grads),
      (e.fsdp ? "float32" + shards + ", from each unit's reduction in backward" : e.param_dtype + ", from backward") +
          std::string(e.early_step ? " until its update there (early_step_in_backward; within the backward row)"
                                   : " until the next step's zero_grad (within the backward row)"));
  row("optimizer state", gib(e.optimizer), "exp_avg, exp_avg_sq and step per parameter" + where);
  row("buffers", gib(e.buffers),
      e.fsdp ? "kept across steps: FSDP's pooled communication buffers, RoPE table"
                   : "kept across steps: RoPE table");
  if (e.ddp_buckets > 0)
    row("DDP buckets", gib(e.ddp_buckets), "25 MB buckets, all in flight at the end of backward (within the backward row)");
  if (e.pp > 1) {
    row("activations", gib(e.activations),
        std::string("alive before the first backward: saved for the microbatches in flight, the batch") +
            (e.fsdp ? ", FSDP's units gathered for the step" : ""));
    row("backward", "+" + gib(e.backward), "over that at the peak: gradients, recomputation, temporaries");
  } else {
    row("activations", gib(e.activations),
        std::string("alive at the end of forward: saved for backward, the loss's logits, the batch") +
            (e.fsdp ? ", FSDP's units still gathered" : ""));
    row("backward", "+" + gib(e.backward), "over the end of forward at the peak: gradients, recomputation, temporaries");
  }
  row("peak", gib(e.peak_device), (e.device == "cpu" ? "CPU, the log line's memory figure: " : "device, allocated: ") +
                                      with_commas(e.peak_device) + " bytes");
  if (host) row("host", gib(e.host), "CPU memory per rank: parameter, gradient and optimizer shards");
  row("resume", gib(e.load_peak),
      std::string(e.device == "cpu" ? "CPU" : "device") + " while a checkpoint loads: the state as held" +
          (e.device == "cpu" ? " + one block being read" : "") + " (" + human(e.load_block) +
          ", read on the host and copied in place; no second copy of the state)");
  if (e.pp > 1) {
    os << "per pipeline rank (activations in flight: most microbatches' held at once, from the schedule's order):\n";
    for (const auto& pr : e.pipeline_ranks) {
      std::string stages;
      for (int s : pr.stages) stages += (stages.empty() ? "" : ",") + std::to_string(s);
      std::snprintf(line, sizeof line, "  rank %-3d stages %-9s in flight %3d  parameters %11s  activations %11s  peak %11s%s\n",
                    pr.rank, stages.c_str(), pr.in_flight, human(pr.params).c_str(), human(pr.activations).c_str(),
                    human(pr.peak).c_str(), pr.rank == e.worst_pp_rank ? "  <- worst" : "");
      os << line;
    }
  }
  os << "peak by activation checkpointing:";
  bool first = true;
  for (const auto& [mode, bytes] : e.peak_by_ac) {
    os << (first ? " " : "; ") << mode << " " << gib(bytes);
    first = false;
  }
  os << "\n";
  std::snprintf(line, sizeof line, "%.3e", e.flops_per_step);
  os << "compute per rank per step: " << line << " FLOPs (" << with_commas(e.tokens_per_step) << " tokens"
     << (e.cp > 1 ? ", of which this rank holds 1/" + std::to_string(e.cp) : "")
     << (e.pp > 1 ? "; its stages' share of the model" : "") << ")\n";
  os << "communication per rank per step (full buffer sizes, as the mesh counts them):";
  if (e.comm_bytes.empty()) os << " none";
  os << "\n";
  for (const auto& [group, ops] : e.comm_bytes) {
    os << "  " << group << ":";
    bool first_op = true;
    for (const auto& [op, bytes] : ops) {
      const int64_t calls = e.comm_calls.count(group) && e.comm_calls.at(group).count(op) ? e.comm_calls.at(group).at(op) : 0;
      os << (first_op ? " " : "; ") << op << " " << human(bytes) << " in " << calls << " call" << (calls == 1 ? "" : "s");
      first_op = false;
    }
    os << "\n";
  }
  const double pct = 100.0 * static_cast<double>(e.peak_device) / static_cast<double>(e.capacity);
  std::snprintf(line, sizeof line, "%.0f%%", pct);
  if (e.fits) {
    os << "verdict: fits: peak " << gib(e.peak_device) << " of " << gib(e.capacity) << " (" << line << ")";
    if (e.device == "cuda" && pct > 90)
      os << ", but within 10% of capacity: the caching allocator's fragmentation, the CUDA context and NCCL may not fit";
  } else {
    os << "verdict: does not fit: peak " << gib(e.peak_device) << " exceeds " << gib(e.capacity) << " (" << line << ")";
  }
  os << "\n";
  return os.str();
}

MemoryBudgetPlan memory_budget_plan(const JobConfig& cfg, int64_t world_size, const std::string& device) {
  {  // resolved already (the pre-flight check's): not a whole estimate again
    std::lock_guard<std::mutex> lock(budget_plans_mutex());
    const auto it = budget_plans().find(budget_plan_key(cfg, world_size, device));
    if (it != budget_plans().end()) return it->second;
  }
  EstimateOptions options;
  options.world_size = world_size;
  options.device = device;
  options.other_ac_modes = false;
  const Estimate e = estimate(cfg, options);
  return {e.ac_block_modes, e.activation_checkpointing};
}

}  // namespace titan
