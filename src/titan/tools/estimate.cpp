#include "titan/tools/estimate.h"

#include "titan/common/error.h"
#include "titan/distributed/parallel_dims.h"
#include "titan/models/registry.h"
#include "titan/tools/dry_run.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
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

// activation_checkpoint.{mode, selective_ac_option} -> the parallelize function's (mode, every k),
// as the trainer maps them.
std::pair<std::string, int64_t> ac_plan(const config::ActivationCheckpoint& ac) {
  if (ac.mode != "selective") return {ac.mode, 1};
  if (ac.selective_ac_option == "op") return {ac.per_op_policy == "all_matmuls" ? "op_all_matmuls" : "op", 1};
  int64_t k = 0;
  try {
    k = std::stoll(ac.selective_ac_option);
  } catch (const std::exception&) {
  }
  TITAN_USER_CHECK(k >= 1, "activation_checkpoint.selective_ac_option '", ac.selective_ac_option,
                   "' is neither a positive integer (every k-th block) nor 'op'");
  return {"selective", k};
}

std::string ac_words(const std::string& mode, int64_t k) {
  if (mode == "none") return "none";
  if (mode == "full") return "full (every block)";
  if (mode == "op") return "selective per operator";
  if (mode == "op_all_matmuls") return "selective per operator, all matmuls kept";
  return "selective " + std::to_string(k) + " (1 block in " + std::to_string(k) + ")";
}

}  // namespace

ModelEstimate estimate_model(const std::string& model, const std::string& flavor, int64_t seq_len) {
  const ModelSpec& spec = model_spec(model);
  LanguageModel m = spec.build(flavor, at::TensorOptions().device(at::kMeta).dtype(at::kFloat), seq_len);
  ModelEstimate e;
  e.model = model;
  e.flavor = flavor;
  e.seq_len = seq_len;
  e.params = m->num_params();
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
  const dist::ParallelDims dims(p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                                p.context_parallel_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree, world);
  check_supported(cfg, world);  // what titan train refuses, the estimate refuses with the same words
  TITAN_USER_CHECK(p.pipeline_parallel_degree == 1, "titan estimate models layouts without pipeline parallelism: "
                   "parallelism.pipeline_parallel_degree ", p.pipeline_parallel_degree, " is not estimated (set it to 1 "
                   "to estimate the data- and tensor-parallel layout of the whole model)");
  TITAN_USER_CHECK(p.context_parallel_degree == 1, "titan estimate models layouts without context parallelism: "
                   "parallelism.context_parallel_degree ", p.context_parallel_degree, " is not estimated (set it to 1 "
                   "to estimate the rest of the layout: every activation per rank is then about cp times what CP "
                   "holds, and FSDP shards over dp_shard x cp)");

  // Precision and data parallelism, decided as Trainer::Trainer decides them.
  const bool cuda = options.device == "cuda";
  const at::ScalarType param_dtype = tr.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  const bool bf16_compute = cuda && tr.mixed_precision_param == "bfloat16" && param_dtype == at::kFloat;
  const bool use_fsdp = dims.fsdp_enabled() || tr.enable_cpu_offload;
  TITAN_USER_CHECK(!use_fsdp || param_dtype == at::kFloat, "training.dtype bfloat16 with FSDP",
                   tr.enable_cpu_offload ? " (CPU offload shards with FSDP)" : "",
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
  plan.dp_replicate = dims.dp_replicate();
  plan.dp_shard = dims.dp_shard();
  plan.cp = dims.cp();
  plan.fsdp = use_fsdp;
  plan.tp = dims.tp();
  dist::check_sequence_length(tr.seq_len, dims.tp(), p.enable_sequence_parallel);
  plan.tp_options.sequence_parallel = p.enable_sequence_parallel;
  plan.tp_options.loss_parallel = !p.disable_loss_parallel;
  plan.tp_options.async = p.enable_async_tensor_parallel;
  plan.reshard_after_forward = p.fsdp_reshard_after_forward;
  std::tie(plan.ac_mode, plan.ac_every) = ac_plan(cfg.activation_checkpoint);
  plan.optimizer = cfg.optimizer.name;
  plan.optimizer_implementation = cfg.optimizer.implementation;
  plan.max_norm = tr.max_norm;
  const DryRunResult r = dry_run(plan);

  Estimate e;
  e.model = estimate_model(cfg.model.name, cfg.model.flavor, tr.seq_len);
  e.world_size = world;
  e.degrees = dims.describe();
  e.shard_degree = use_fsdp ? dims.dp_shard() * dims.cp() : 1;
  e.layout = use_fsdp ? (dims.dp_replicate_enabled() ? "HSDP" : "FSDP") : dims.ddp_enabled() ? "DDP" : "single process";
  if (dims.tp() > 1)
    e.layout = (e.layout == "single process" ? "" : e.layout + " + ") + "TP " + std::to_string(dims.tp()) +
               (p.enable_sequence_parallel ? " (sequence parallel)" : "");
  e.device = options.device;
  e.compute_dtype = dtype_name(bf16_compute ? at::kBFloat16 : param_dtype);
  e.param_dtype = dtype_name(param_dtype);
  e.offload = tr.enable_cpu_offload;
  e.activation_checkpointing = ac_words(plan.ac_mode, plan.ac_every);
  e.local_batch_size = tr.local_batch_size;
  e.grad_accum_steps = plan.grad_accum_steps;

  e.params = r.params;
  e.grads = r.grads;
  e.optimizer = r.optimizer;
  e.grads_kept = use_fsdp;
  e.buffers = r.buffers;
  e.ddp_buckets = r.ddp_buckets;
  const int64_t peak = std::max(r.peak, r.first_step_peak);
  const int64_t held = r.params + r.optimizer + r.buffers + (e.grads_kept ? r.grads : 0);
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

  // The same run under the other activation checkpointing modes (their device peaks).
  const int64_t k = plan.ac_mode == "selective" ? plan.ac_every : 2, offloaded = peak - e.peak_device;
  e.peak_by_ac[ac_words(plan.ac_mode, plan.ac_every)] = e.peak_device;
  const std::vector<std::pair<std::string, int64_t>> modes = {{"none", 1}, {"full", 1}, {"selective", k}};
  for (const auto& [mode, every] : modes) {
    const std::string words = ac_words(mode, every);
    if (e.peak_by_ac.count(words)) continue;
    DryRunPlan other = plan;
    other.ac_mode = mode;
    other.ac_every = every;
    const DryRunResult o = dry_run(other);
    e.peak_by_ac[words] = std::max(o.peak, o.first_step_peak) - offloaded;
  }

  e.tokens_per_step = plan.grad_accum_steps * tr.local_batch_size * tr.seq_len;
  // The tensor-parallel ranks share each of this rank's tokens: each computes 1/tp of their FLOPs.
  e.flops_per_step = e.model.flops_per_token * static_cast<double>(e.tokens_per_step) / static_cast<double>(dims.tp());
  e.comm_bytes = r.bytes;
  e.comm_calls = r.calls;
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
  row("parameters", gib(e.params), std::string(e.grads_kept ? "float32" : e.param_dtype) + shards);
  row("gradients", gib(e.grads),
      e.grads_kept ? "float32" + shards + ", kept between steps"
                   : e.param_dtype + std::string(", produced by backward (within the backward row)"));
  row("optimizer state", gib(e.optimizer), "exp_avg, exp_avg_sq and step per parameter" + where);
  row("buffers", gib(e.buffers),
      e.grads_kept ? "kept across steps: FSDP's gathered units and reduce-scatter buffers, RoPE table"
                   : "kept across steps: RoPE table");
  if (e.ddp_buckets > 0)
    row("DDP buckets", gib(e.ddp_buckets), "25 MB buckets, all in flight at the end of backward (within the backward row)");
  row("activations", gib(e.activations), "alive at the end of forward: saved for backward, the loss's logits, the batch");
  row("backward", "+" + gib(e.backward), "over the end of forward at the peak: gradients, recomputation, temporaries");
  row("peak", gib(e.peak_device), (e.device == "cpu" ? "CPU, the log line's memory figure: " : "device, allocated: ") +
                                      with_commas(e.peak_device) + " bytes");
  if (host) row("host", gib(e.host), "CPU memory per rank: parameter, gradient and optimizer shards");
  os << "peak by activation checkpointing:";
  bool first = true;
  for (const auto& [mode, bytes] : e.peak_by_ac) {
    os << (first ? " " : "; ") << mode << " " << gib(bytes);
    first = false;
  }
  os << "\n";
  std::snprintf(line, sizeof line, "%.3e", e.flops_per_step);
  os << "compute per rank per step: " << line << " FLOPs (" << with_commas(e.tokens_per_step) << " tokens)\n";
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

}  // namespace titan
