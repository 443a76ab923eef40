// Validation: the loss on held-out data, evaluated without gradients under whatever layout trains
// (FSDP gathers, TP's collectives and loss parallel run as in the training forward).
#include "titan/common/autocast.h"
#include "titan/common/error.h"
#include "titan/trainer/trainer.h"

#include <ATen/ATen.h>

#include <chrono>

namespace titan {

void Trainer::set_up_validation() {
  const auto& v = cfg_.validation;
  if (!v.enable) return;
  if (dims_->tp() > 1)
    dist::check_sequence_length(v.seq_len, dims_->tp(), tensor_parallel_->options().sequence_parallel, "validation.seq_len");
  if (context_parallel_)
    dist::check_context_parallel_sequence(v.seq_len, dims_->cp(), context_parallel_->options().load_balance,
                                          dims_->tp(), tensor_parallel_ && tensor_parallel_->options().sequence_parallel,
                                          "validation.seq_len");
  data::DataConfig dc = data::data_config(v, (*mesh_)["dp"].rank(), static_cast<int>(dims_->dp_size()));
  dc.together = tokenize_together("data_validation");
  try {
    val_loader_ = data::make_dataloader(dc, *tokenizer_);
  } catch (const UserError& e) {
    throw UserError(std::string("validation data: ") + e.what());
  }
  const int64_t mbs = cfg_.parallelism.pipeline_parallel_microbatch_size;
  TITAN_USER_CHECK(dims_->pp() == 1 || v.local_batch_size % mbs == 0, "validation.local_batch_size ", v.local_batch_size,
                   " is not a multiple of parallelism.pipeline_parallel_microbatch_size ", mbs,
                   ": the pipeline evaluates whole microbatches");
  val_start_state_ = val_loader_->state();
  log_info("Validation: " + val_loader_->description() + "; every " + std::to_string(v.freq) + " steps, " +
           (v.steps < 0 ? std::string("one pass over the data") : std::to_string(v.steps) + " batches") + " of " +
           std::to_string(v.local_batch_size) + " x " + std::to_string(v.seq_len) + " tokens per data-parallel rank");
}

metrics::ValidationStats Trainer::validate() {
  TITAN_ASSERT(val_loader_, "validate() without validation.enable");
  const auto& v = cfg_.validation;
  const auto start = std::chrono::steady_clock::now();
  at::NoGradGuard no_grad;
  // Evaluation routes tokens without counting them for the routing biases' update. (Grad mode cannot
  // tell the layer: under full activation checkpointing the training forward of a block runs without
  // gradients too, and is the one that counts.)
  struct CountingOff {
    std::vector<std::pair<std::string, nn::MoEImpl*>>& layers;
    explicit CountingOff(std::vector<std::pair<std::string, nn::MoEImpl*>>& l) : layers(l) {
      for (auto& [prefix, layer] : layers) layer->count_tokens = false;
    }
    ~CountingOff() {
      for (auto& [prefix, layer] : layers) layer->count_tokens = true;
    }
  } counting_off(moe_layers_);
  val_loader_->load_state(val_start_state_);
  // Sums in float64: the average over many batches does not depend on the order of the additions
  // beyond float64 rounding, so every layout reports the same figure.
  at::Tensor loss_sum = at::zeros({}, at::TensorOptions().device(device_).dtype(at::kDouble));
  int64_t batches = 0, tokens = 0;
  // With steps = -1, one pass: every batch that starts in the first pass over the data (the stream is
  // global, so every rank stops at the same batch).
  while (v.steps < 0 ? batches == 0 || val_loader_->epoch() == 0 : batches < v.steps) {
    data::Batch batch = val_loader_->next();
    if (context_parallel_) {  // this rank's part of every sequence
      batch.inputs = context_parallel_->shard(batch.inputs, 1);
      batch.labels = context_parallel_->shard(batch.labels, 1);
    }
    to_device(batch);
    const at::Tensor &inputs_BS = batch.inputs, &labels_BS = batch.labels;
    if (pipeline_) {
      loss_sum += pipeline_evaluate(inputs_BS, labels_BS);
    } else {
      CudaBf16Autocast autocast(bf16_autocast_);
      at::Tensor logits_BSV = model_->forward(inputs_BS);
      loss_sum += parallelized_.loss_sum(logits_BSV.flatten(0, 1), labels_BS.flatten(0, 1)).to(at::kDouble);
    }
    tokens += labels_BS.numel() * dims_->cp();  // the whole sequences
    ++batches;
  }
  if (pipeline_) (*mesh_)["pp"].all_reduce(loss_sum).wait();  // the last stage's sum, to every rank
  if (context_parallel_) (*mesh_)["cp"].all_reduce(loss_sum).wait();  // every part of the sequences
  (*mesh_)["dp"].all_reduce(loss_sum).wait();
  metrics::ValidationStats s;
  s.step = step_;
  s.loss = loss_sum.item<double>() / static_cast<double>(tokens * dims_->dp_size());
  s.tokens = tokens;
  s.seconds = std::max(1e-9, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return s;
}

}  // namespace titan
