// Sanity checks of a resolved config that hold whatever features are enabled.
#include "titan/common/error.h"
#include "titan/common/preemption.h"
#include "titan/config/job_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>

namespace titan {

namespace {

void positive(int64_t value, const char* key) {
  TITAN_USER_CHECK(value > 0, key, " must be positive, got ", value);
}

void in_unit_interval(double value, const char* key) {
  TITAN_USER_CHECK(value >= 0.0 && value <= 1.0, key, " must be between 0 and 1, got ", value);
}

bool is_positive_integer(const std::string& s) {
  if (s.empty() || s.size() > 9) return false;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return std::stol(s) > 0;
}

// Steps the learning-rate schedule spans (lr_scheduler.total_steps, else training.steps).
int64_t schedule_steps(const JobConfig& cfg) { return cfg.lr_scheduler.total_steps.value_or(cfg.training.steps); }

}  // namespace

void validate_config(const JobConfig& cfg) {
  const auto& t = cfg.training;
  positive(t.steps, "training.steps");
  positive(t.local_batch_size, "training.local_batch_size");
  positive(t.seq_len, "training.seq_len");
  TITAN_USER_CHECK(t.global_batch_size == -1 || t.global_batch_size > 0,
                   "training.global_batch_size must be positive, or -1 for local_batch_size times the "
                   "data-parallel degree; got ", t.global_batch_size);
  TITAN_USER_CHECK(t.global_batch_size == -1 || t.global_batch_size % t.local_batch_size == 0,
                   "training.global_batch_size (", t.global_batch_size, ") must be a multiple of "
                   "training.local_batch_size (", t.local_batch_size, ")");
  TITAN_USER_CHECK(t.max_norm > 0, "training.max_norm must be positive, got ", t.max_norm);
  for (const std::string& name : cfg.job.preemption_signals) (void)preemption_signal_number(name);
  TITAN_USER_CHECK(cfg.job.preemption_grace_seconds >= 0, "job.preemption_grace_seconds must be >= 0 (0: no limit), got ",
                   cfg.job.preemption_grace_seconds);

  if (cfg.model.moe_aux_loss_coeff)
    TITAN_USER_CHECK(*cfg.model.moe_aux_loss_coeff >= 0 && std::isfinite(*cfg.model.moe_aux_loss_coeff),
                     "model.moe_aux_loss_coeff must be a finite number >= 0 (0: no auxiliary loss), got ",
                     *cfg.model.moe_aux_loss_coeff);

  const auto& o = cfg.optimizer;
  TITAN_USER_CHECK(o.lr >= 0, "optimizer.lr must not be negative, got ", o.lr);
  TITAN_USER_CHECK(o.beta1 >= 0 && o.beta1 < 1, "optimizer.beta1 must be in [0, 1), got ", o.beta1);
  TITAN_USER_CHECK(o.beta2 >= 0 && o.beta2 < 1, "optimizer.beta2 must be in [0, 1), got ", o.beta2);
  TITAN_USER_CHECK(o.eps > 0, "optimizer.eps must be positive, got ", o.eps);
  TITAN_USER_CHECK(o.weight_decay >= 0, "optimizer.weight_decay must not be negative, got ", o.weight_decay);

  if (o.early_step_in_backward) {
    const auto& par = cfg.parallelism;
    const char* why = "optimizer.early_step_in_backward updates each parameter inside the backward";
    TITAN_USER_CHECK(par.pipeline_parallel_degree == 1, why, ", which pipeline parallelism runs once per microbatch in "
                     "its schedule (parallelism.pipeline_parallel_degree = ", par.pipeline_parallel_degree,
                     "): turn one of them off");
    TITAN_USER_CHECK(par.expert_parallel_degree == 1, why, "; it does not run with expert parallelism "
                     "(parallelism.expert_parallel_degree = ", par.expert_parallel_degree, "): turn one of them off");
    TITAN_USER_CHECK(t.nan_policy != "skip", why, ", before the step's loss and gradient norm are known, so a step "
                     "cannot be skipped as a whole (training.nan_policy = \"skip\"); use nan_policy = \"stop\", "
                     "which ends the run at the first non-finite step, saving nothing after it (that step skips "
                     "every update whose gradients, or this rank's loss, are not finite; later steps skip all)");
  }

  const auto& s = cfg.lr_scheduler;
  TITAN_USER_CHECK(s.warmup_steps >= 0, "lr_scheduler.warmup_steps must not be negative, got ", s.warmup_steps);
  if (s.total_steps) positive(*s.total_steps, "lr_scheduler.total_steps");
  if (s.decay_ratio) in_unit_interval(*s.decay_ratio, "lr_scheduler.decay_ratio");
  in_unit_interval(s.min_lr_factor, "lr_scheduler.min_lr_factor");

  positive(cfg.metrics.log_freq, "metrics.log_freq");
  positive(cfg.profiling.profile_freq, "profiling.profile_freq");
  positive(cfg.profiling.profiler_active, "profiling.profiler_active");
  TITAN_USER_CHECK(cfg.profiling.profiler_warmup >= 0, "profiling.profiler_warmup must not be negative");
  TITAN_USER_CHECK(!cfg.profiling.enable_profiling ||
                       cfg.profiling.profile_freq >= cfg.profiling.profiler_warmup + cfg.profiling.profiler_active,
                   "profiling.profile_freq (", cfg.profiling.profile_freq, ") must be at least profiler_warmup + "
                   "profiler_active (", cfg.profiling.profiler_warmup, " + ", cfg.profiling.profiler_active,
                   "): every cycle of profile_freq steps ends with the warm-up and the recorded steps");

  const auto& p = cfg.parallelism;
  TITAN_USER_CHECK(p.data_parallel_shard_degree == -1 || p.data_parallel_shard_degree >= 1,
                   "parallelism.data_parallel_shard_degree must be -1 (the ranks left over) or at least 1, got ",
                   p.data_parallel_shard_degree);
  positive(p.data_parallel_replicate_degree, "parallelism.data_parallel_replicate_degree");
  positive(p.tensor_parallel_degree, "parallelism.tensor_parallel_degree");
  positive(p.pipeline_parallel_degree, "parallelism.pipeline_parallel_degree");
  positive(p.context_parallel_degree, "parallelism.context_parallel_degree");
  positive(p.expert_parallel_degree, "parallelism.expert_parallel_degree");
  positive(p.expert_tensor_parallel_degree, "parallelism.expert_tensor_parallel_degree");
  TITAN_USER_CHECK(p.expert_tensor_parallel_degree == 1, "parallelism.expert_tensor_parallel_degree ",
                   p.expert_tensor_parallel_degree, " is not supported: experts are not split by tensor parallelism "
                   "(torchtitan removed it too: the experts of fine-grained MoE models are small, and splitting them "
                   "makes their matrix multiplications too small to run fast). Set it to 1 and spread the experts "
                   "with parallelism.expert_parallel_degree");
  positive(p.pipeline_parallel_microbatch_size, "parallelism.pipeline_parallel_microbatch_size");
  if (p.pipeline_parallel_layers_per_stage)
    positive(*p.pipeline_parallel_layers_per_stage, "parallelism.pipeline_parallel_layers_per_stage");
  TITAN_USER_CHECK(p.pipeline_parallel_first_stage_less_layers >= 0, "parallelism.pipeline_parallel_first_stage_less_layers "
                   "must not be negative, got ", p.pipeline_parallel_first_stage_less_layers);
  TITAN_USER_CHECK(p.pipeline_parallel_last_stage_less_layers >= 0, "parallelism.pipeline_parallel_last_stage_less_layers "
                   "must not be negative, got ", p.pipeline_parallel_last_stage_less_layers);
  // The names themselves are checked against the model where the stages are built.
  for (size_t i = 0; i < p.module_fqns_per_model_part.size(); ++i) {
    const auto& part = p.module_fqns_per_model_part[i];
    TITAN_USER_CHECK(!part.empty(), "parallelism.module_fqns_per_model_part: model part ", i,
                     " is empty; each part (pipeline stage) needs at least one module name");
    for (const auto& name : part)
      TITAN_USER_CHECK(!name.empty(), "parallelism.module_fqns_per_model_part: model part ", i,
                       " has an empty module name");
  }

  const auto& c = cfg.checkpoint;
  positive(c.interval, "checkpoint.interval");
  positive(c.save_timeout_seconds, "checkpoint.save_timeout_seconds");
  TITAN_USER_CHECK(c.keep_latest_k >= 0 && c.keep_latest_k != 1,
                   "checkpoint.keep_latest_k must be 0 (keep all) or at least 2 (the newest may still be "
                   "being written), got ", c.keep_latest_k);
  TITAN_USER_CHECK(c.load_step >= -1, "checkpoint.load_step must be a step or -1 (the latest), got ", c.load_step);

  const auto& ac = cfg.activation_checkpoint;
  TITAN_USER_CHECK(ac.mode != "selective" || ac.selective_ac_option == "op" || is_positive_integer(ac.selective_ac_option),
                   "activation_checkpoint.selective_ac_option must be 'op' or a positive integer, got '",
                   ac.selective_ac_option, "'");
  in_unit_interval(ac.memory_budget, "activation_checkpoint.memory_budget");
  TITAN_USER_CHECK(ac.per_op_policy == "every_other_matmul" || (ac.mode == "selective" && ac.selective_ac_option == "op"),
                   "activation_checkpoint.per_op_policy '", ac.per_op_policy, "' chooses what the per-operator policy "
                   "keeps, which runs only with mode = \"selective\" and selective_ac_option = \"op\" (mode is '",
                   ac.mode, "', selective_ac_option '", ac.selective_ac_option, "')",
                   ac.mode == "memory_budget" ? "; memory_budget chooses each block's policy itself" : "",
                   ": set those, or leave per_op_policy out");

  const auto& v = cfg.validation;
  positive(v.freq, "validation.freq");
  positive(v.local_batch_size, "validation.local_batch_size");
  positive(v.seq_len, "validation.seq_len");
  TITAN_USER_CHECK(v.steps > 0 || v.steps == -1, "validation.steps must be positive or -1 (all), got ", v.steps);

  positive(cfg.comm.init_timeout_seconds, "comm.init_timeout_seconds");
  positive(cfg.comm.train_timeout_seconds, "comm.train_timeout_seconds");
  TITAN_USER_CHECK(cfg.comm.trace_buf_size >= 0, "comm.trace_buf_size must be 0 (no flight recorder) or positive, got ",
                   cfg.comm.trace_buf_size);
}

int64_t global_batch_size(const JobConfig& cfg, int64_t dp_degree) {
  const auto& tr = cfg.training;
  const int64_t global_batch = tr.global_batch_size < 0 ? tr.local_batch_size * dp_degree : tr.global_batch_size;
  TITAN_USER_CHECK(global_batch % (tr.local_batch_size * dp_degree) == 0, "training.global_batch_size ", global_batch,
                   " is not a multiple of local_batch_size ", tr.local_batch_size, " x data-parallel degree ",
                   dp_degree);
  return global_batch;
}

std::vector<std::string> config_warnings(const JobConfig& cfg) {
  std::vector<std::string> out;
  const int64_t total = schedule_steps(cfg);
  const int64_t warmup = std::min(cfg.lr_scheduler.warmup_steps, total);
  if (cfg.lr_scheduler.warmup_steps > total)
    out.push_back(detail::concat("lr_scheduler.warmup_steps (", cfg.lr_scheduler.warmup_steps, ") exceeds the ",
                                 total, " steps of the schedule; warmup is shortened to ", total, " steps"));
  if (cfg.lr_scheduler.decay_ratio) {
    // Rounds half to even, as the schedule does.
    const auto decay = static_cast<int64_t>(std::nearbyint(static_cast<double>(total) * *cfg.lr_scheduler.decay_ratio));
    if (warmup + decay > total)
      out.push_back(detail::concat("warmup (", warmup, ") + decay (", decay, ") steps exceed the ", total,
                                   " steps of the schedule; decay is shortened to ", total - warmup, " steps"));
  }
  if (cfg.parallelism.tensor_parallel_degree <= 1 && cfg.parallelism.enable_async_tensor_parallel)
    out.push_back("parallelism.enable_async_tensor_parallel has no effect without tensor parallelism "
                  "(parallelism.tensor_parallel_degree is 1)");
  return out;
}

}  // namespace titan
