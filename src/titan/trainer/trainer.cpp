#include "titan/trainer/trainer.h"

#include "titan/common/error.h"
#include "titan/components/metrics/format.h"
#include "titan/config/field.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/cuda.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

namespace titan {
namespace {

using Clock = std::chrono::steady_clock;

void log_info(const std::string& msg) { std::cout << metrics::log_prefix() << msg << std::endl; }

// bf16 autocast on CUDA for the forward pass and the loss, when mixed precision asks for it.
struct AutocastGuard {
  bool on;
  explicit AutocastGuard(bool enable) : on(enable) {
    if (!on) return;
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
  }
  ~AutocastGuard() {
    if (!on) return;
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
  }
};

}  // namespace

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

Trainer::Trainer(JobConfig cfg) : cfg_(std::move(cfg)) {
  check_supported(cfg_, /*world_size=*/1);
  const auto& tr = cfg_.training;

  // ---- device, seed, determinism, precision
  if (torch::cuda::is_available()) device_ = c10::Device(c10::kCUDA, 0);
  const uint64_t seed = static_cast<uint64_t>(cfg_.debug.seed.value_or(0));
  at::manual_seed(seed);
  if (cfg_.debug.deterministic) {
    at::globalContext().setDeterministicAlgorithms(true, cfg_.debug.deterministic_warn_only);
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
  }
  // fp32 master weights; on CUDA the forward runs under bf16 autocast (mixed_precision_param).
  const at::ScalarType param_dtype = tr.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  bf16_autocast_ = device_.is_cuda() && tr.mixed_precision_param == "bfloat16" && param_dtype == at::kFloat;

  // ---- tokenizer and model
  tokenizer_ = load_tokenizer(cfg_.model.hf_assets_path);
  const ModelSpec& spec = model_spec(cfg_.model.name);
  model_ = spec.build(cfg_.model.flavor, at::TensorOptions().device(device_).dtype(param_dtype), tr.seq_len);
  model_->init_weights(seed);
  const int64_t vocab = model_->named_parameters()["tok_embeddings.weight"].size(0);
  TITAN_USER_CHECK(tokenizer_->vocab_size() <= vocab, "the tokenizer at ", cfg_.model.hf_assets_path, " has ",
                   tokenizer_->vocab_size(), " tokens but model ", cfg_.model.name, " ", cfg_.model.flavor,
                   " has a vocabulary of ", vocab, ": choose the flavor's tokenizer with --model.hf_assets_path");

  // ---- optimizer and learning-rate schedule
  std::vector<std::pair<std::string, at::Tensor>> named;
  for (const auto& p : model_->named_parameters()) named.emplace_back(p.key(), p.value());
  const auto& o = cfg_.optimizer;
  TITAN_USER_CHECK(o.implementation != "foreach", "optimizer.implementation 'foreach' is not supported; use fused "
                   "(the default) or for-loop, which compute the same update");
  optimizer_ = std::make_unique<Optimizer>(
      named, OptimizerOptions{o.name, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.implementation});
  const auto& ls = cfg_.lr_scheduler;
  lr_schedule_ = std::make_unique<LRSchedule>(LRScheduleOptions{ls.warmup_steps, ls.decay_ratio, ls.decay_type, ls.min_lr_factor},
                                              ls.total_steps.value_or(tr.steps));

  // ---- data: one process reads the whole global batch, in micro-batches of local_batch_size
  const int64_t global_batch = tr.global_batch_size < 0 ? tr.local_batch_size : tr.global_batch_size;
  TITAN_USER_CHECK(global_batch % tr.local_batch_size == 0, "training.global_batch_size ", global_batch,
                   " is not a multiple of local_batch_size ", tr.local_batch_size, " x data-parallel degree 1");
  grad_accum_steps_ = global_batch / tr.local_batch_size;
  data::DataConfig dc;
  dc.dataset = tr.dataset;
  dc.dataset_path = tr.dataset_path;
  dc.local_batch_size = tr.local_batch_size;
  dc.seq_len = tr.seq_len;
  dataloader_ = data::make_dataloader(dc, *tokenizer_);

  // ---- metrics
  metrics::MetricsOptions mo;
  mo.log_freq = cfg_.metrics.log_freq;
  mo.enable_tensorboard = cfg_.metrics.enable_tensorboard;
  mo.save_tb_folder = cfg_.metrics.save_tb_folder;
  mo.save_for_all_ranks = cfg_.metrics.save_for_all_ranks;
  mo.dump_folder = cfg_.job.dump_folder;
  mo.color = metrics::default_color(cfg_.metrics.disable_color_printing);
  mo.total_steps = tr.steps;
  mo.device = device_;
  metrics_ = std::make_unique<metrics::MetricsLogger>(mo);

  // ---- what this run is, for the log; the resolved config goes to dump_folder
  std::filesystem::create_directories(cfg_.job.dump_folder);
  const std::string saved = cfg_.job.dump_folder + "/" +
                            (cfg_.job.save_config_file.empty() ? "config.toml" : cfg_.job.save_config_file);
  std::ofstream(saved) << to_toml(cfg_);
  log_info("Starting job: " + cfg_.job.description);
  if (cfg_.job.print_config) {
    std::cout << to_toml(cfg_);
  } else {
    std::string changes = config_changes(cfg_);
    log_info("Config (differences from the defaults; full config in " + saved + "):\n" + changes);
  }
  for (const auto& w : config_warnings(cfg_)) log_info("Warning: " + w);
  char buf[512];
  std::snprintf(buf, sizeof buf, "Model %s %s: %s parameters, %.3e training FLOPs per token; device %s%s",
                cfg_.model.name.c_str(), cfg_.model.flavor.c_str(),
                metrics::format_thousands(model_->num_params()).c_str(), model_->flops_per_token(tr.seq_len),
                device_.str().c_str(), bf16_autocast_ ? ", bf16 autocast" : "");
  log_info(buf);
  log_info("Data: " + dataloader_->description() + "; tokenizer vocabulary " +
           std::to_string(tokenizer_->vocab_size()));
  log_info("Training " + std::to_string(tr.steps) + " steps: local batch " + std::to_string(tr.local_batch_size) +
           ", global batch " + std::to_string(global_batch) + ", gradient accumulation steps " +
           std::to_string(grad_accum_steps_) + ", sequence length " + std::to_string(tr.seq_len));
}

StepResult Trainer::train_step() {
  const auto& tr = cfg_.training;
  optimizer_->zero_grad();
  StepResult r;
  r.lr = cfg_.optimizer.lr * lr_schedule_->factor(step_);
  optimizer_->set_lr(r.lr);

  // Every micro-batch's loss is a sum over its tokens divided by the tokens of the whole global
  // batch, so the accumulated gradient equals the gradient of the big-batch mean loss.
  const double global_tokens = static_cast<double>(grad_accum_steps_ * tr.local_batch_size * tr.seq_len);
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().device(device_).dtype(at::kFloat));
  for (int64_t micro = 0; micro < grad_accum_steps_; ++micro) {
    const auto t0 = Clock::now();
    data::Batch batch = dataloader_->next();
    data_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();
    at::Tensor inputs_BS = batch.inputs.to(device_), labels_BS = batch.labels.to(device_);
    at::Tensor loss;
    {
      AutocastGuard autocast(bf16_autocast_);
      at::Tensor logits_BSV = model_->forward(inputs_BS);
      loss = at::cross_entropy_loss(logits_BSV.flatten(0, 1).to(at::kFloat), labels_BS.flatten(0, 1), {},
                                    at::Reduction::Sum) /
             global_tokens;
    }
    loss.backward();
    loss_sum += loss.detach();
    ntokens_seen_ += labels_BS.numel();
  }
  r.grad_norm = clip_grad_norm(model_->parameters(), tr.max_norm);
  optimizer_->step();
  ++step_;
  r.loss = loss_sum.item<double>();
  return r;
}

std::vector<double> Trainer::train() {
  std::vector<double> losses;
  const auto& tr = cfg_.training;
  auto interval_start = Clock::now();
  int64_t tokens_at_last_log = 0, step_at_last_log = 0;
  while (step_ < tr.steps) {
    StepResult r = train_step();
    TITAN_USER_CHECK(std::isfinite(r.loss), "the loss became ", r.loss, " at step ", step_,
                     ": lower optimizer.lr or check the data");
    losses.push_back(r.loss);
    metrics_->on_step(step_);
    if (!metrics_->should_log(step_)) continue;
    if (device_.is_cuda()) torch::cuda::synchronize();
    metrics::StepStats s;
    s.step = step_;
    s.loss = s.max_loss = r.loss;
    s.grad_norm = r.grad_norm;
    s.lr = r.lr;
    s.tokens_since_last_log = ntokens_seen_ - tokens_at_last_log;
    s.seconds_since_last_log = std::chrono::duration<double>(Clock::now() - interval_start).count();
    s.steps_since_last_log = step_ - step_at_last_log;
    s.flops_per_token = model_->flops_per_token(tr.seq_len);
    s.ntokens_seen = ntokens_seen_;
    s.data_loading_seconds = data_seconds_;
    metrics_->log(s);
    interval_start = Clock::now();
    tokens_at_last_log = ntokens_seen_;
    step_at_last_log = step_;
    data_seconds_ = 0;
  }
  log_info("Training completed");
  return losses;
}

int run_training(const JobConfig& cfg) {
  Trainer trainer(cfg);
  trainer.train();
  return 0;
}

}  // namespace titan
