// The trainer under pipeline parallelism: the model cut into stages over the `pp` mesh dimension,
// this rank's stages built and parallelized like whole models (TP inside, activation checkpointing,
// FSDP/HSDP/DDP per stage), and a schedule run by dist::PipelineRunner (docs/parallelism.md).
//
// Stages and schedule: plan_pipeline (models/pipeline_split.h), which `titan estimate` uses too.
// Every parameter keeps its global name and its initial values (a function of seed and name), so a
// stage initializes exactly what the single process would, and checkpoints are layout-free.
#include "titan/common/autocast.h"
#include "titan/common/error.h"
#include "titan/common/fault_injection.h"
#include "titan/common/tensor_storage.h"
#include "titan/common/trace.h"
#include "titan/models/pipeline_split.h"
#include "titan/trainer/trainer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <set>

namespace titan {

void Trainer::set_up_pipeline(const ModelSpec& spec, ParallelizeContext pctx,
                              const std::function<std::unique_ptr<dist::DataParallel>()>& make_dp,
                              const at::TensorOptions& param_options, int64_t max_seq_len, at::ScalarType boundary_dtype) {
  const auto& par = cfg_.parallelism;
  const auto& tr = cfg_.training;
  const int pp = static_cast<int>(dims_->pp());
  const PipelinePlan plan = plan_pipeline(spec, cfg_.model.flavor, par, tr.local_batch_size);
  stage_modules_ = plan.stage_modules;
  const dist::PipelineOrder& order = plan.order;
  const std::vector<int>& ranks = plan.stage_ranks;
  const int num_stages = static_cast<int>(stage_modules_.size()), per_rank = num_stages / pp;
  const int microbatches = plan.microbatches;
  const int64_t mbs = plan.microbatch_size;

  // ---- this rank's stages, each parallelized like a whole model
  dist::Group& pp_group = (*mesh_)["pp"];
  std::vector<dist::PipelineStage> stages;
  std::string held;
  for (int s = 0; s < num_stages; ++s) {
    if (ranks[s] != pp_group.rank()) continue;
    LanguageModel stage_model;
    {
      DeferAllocation defer;
      stage_model = spec.build_stage(cfg_.model.flavor, param_options, max_seq_len, stage_modules_[s]);
    }
    convert_to_float8(*stage_model, float8_, cfg_.float8, /*record=*/false, /*require_some=*/false);
    data_parallel_.push_back(make_dp());
    dist::DataParallel* dp = data_parallel_.back().get();
    pctx.data_parallel = dp;
    ParallelizedModel pm = spec.parallelize(*stage_model, pctx);
    if (s == num_stages - 1) parallelized_ = pm;
    dp->set_gradient_sync(false);  // reduced once per step, after the schedule (reduce_gradients)
    dist::PipelineStage ps;
    ps.index = s;
    LanguageModelImpl* m = stage_model.get();
    ps.forward = [this, m](const at::Tensor& in) {
      CudaBf16Autocast autocast(bf16_autocast_);
      return m->forward(in, pipeline_seq_len_);
    };
    // A parameter shared with another stage (a tied embedding table, first and last stage): its
    // gradients are summed with the other copy's after backward, over the pp group.
    // (plan_pipeline refuses a schedule that puts both stages on one rank.)
    for (const auto& shared : stage_model->shared_parameters()) {
      const int other = shared.primary ? num_stages - 1 : 0;
      TITAN_ASSERT(ranks[other] != pp_group.rank(), "shared parameter ", shared.name, " on one pipeline rank twice");
      shared_gradients_.push_back({shared.name, shared.primary, ranks[other]});
    }
    ps.parameters = stage_model->parameters();
    ps.after_backward = [dp] { dp->after_backward(false); };
    stages.push_back(std::move(ps));
    stage_models_.push_back(stage_model);
    held += (held.empty() ? "" : "; ") + std::to_string(s) + ": " + stage_modules_[s].front() +
            (stage_modules_[s].size() > 1 ? " .. " + stage_modules_[s].back() : "");
  }
  pipeline_ = std::make_unique<dist::PipelineRunner>(pp_group, order, num_stages, microbatches, std::move(stages),
                                                     at::TensorOptions().device(device_).dtype(boundary_dtype));
  log_info("Pipeline: " + std::to_string(num_stages) + " stages over " + std::to_string(pp) + " ranks (" +
           std::to_string(per_rank) + " per rank), schedule " + plan.schedule + ", " + std::to_string(microbatches) +
           " microbatches of " + std::to_string(mbs) + "; rank 0 holds stage(s) " + held);
}

at::Tensor Trainer::pipeline_forward_backward(int64_t step, double global_tokens) {
  const auto& tr = cfg_.training;
  const int64_t mbs = cfg_.parallelism.pipeline_parallel_microbatch_size;
  const int64_t attended = tr.seq_len / dims_->cp();  // the rank's context-parallel part
  const int64_t seq_local =
      tensor_parallel_ && tensor_parallel_->options().sequence_parallel ? attended / dims_->tp() : attended;
  const std::vector<int64_t> boundary = {mbs, seq_local, model_->hidden_size()};
  at::Tensor total = at::zeros({}, at::TensorOptions().device(device_).dtype(at::kFloat));
  for (int64_t micro = 0; micro < grad_accum_steps_; ++micro) {
    const data::Batch batch = next_batch(step);
    const at::Tensor &inputs_BS = batch.inputs, &labels_BS = batch.labels;
    fault::point("forward", step);
    pipeline_seq_len_ = attended;
    // The backward fault point fires on every rank, at its first backward action of the step; the
    // loss point (and a NaN loss) on the ranks of the last stage, which compute the loss.
    if (fault::enabled())
      pipeline_->before_action = [step](const dist::PipeAction& a) {
        if (a.op != dist::PipeOp::Forward) fault::point("backward", step);
      };
    at::Tensor losses = pipeline_->train_step(
        boundary, [&](int m) { return inputs_BS.narrow(0, m * mbs, mbs); },
        [&](int m, const at::Tensor& logits_BSV) {
          return loss_of(logits_BSV, labels_BS.narrow(0, m * mbs, mbs), step, global_tokens);
        });
    total += losses.to(total.device(), at::kFloat);
    ntokens_seen_ += labels_BS.numel() * dims_->cp();
  }
  TraceRange range(mem::Phase::Communication, "pipeline gradient reduction");
  for (auto& dp : data_parallel_) dp->reduce_gradients();
  sum_shared_gradients();
  return total;
}

void Trainer::sum_shared_gradients() {
  if (shared_gradients_.empty()) return;
  // Each copy's gradient (already reduced over its data-parallel peers, so both hold the same shard
  // of it) goes to the other copy's rank, which adds it. Messages between the two ranks are posted in
  // one order on both sides (the primary sends first), so that order-matched point-to-point (NCCL)
  // pairs them; a tag of its own keeps them apart from the schedule's on Gloo.
  constexpr int kTag = 1 << 20;
  dist::Group& pp = (*mesh_)["pp"];
  for (const SharedGradient& s : shared_gradients_) {
    at::Tensor grad = params_[s.param].local.grad();
    TITAN_ASSERT(grad.defined(), "shared parameter ", s.name, " has no gradient after backward");
    const at::Tensor mine_out = grad.to(mesh_->device()).contiguous();
    at::Tensor theirs = at::empty_like(mine_out);
    if (s.primary) {
      pp.send(mine_out, s.peer, kTag).wait();
      pp.recv(theirs, s.peer, kTag).wait();
    } else {
      pp.recv(theirs, s.peer, kTag).wait();
      pp.send(mine_out, s.peer, kTag).wait();
    }
    at::NoGradGuard no_grad;
    grad.add_(theirs.to(grad.device()));
  }
}

bool Trainer::is_shared_copy(const std::string& name) const {
  for (const SharedGradient& s : shared_gradients_)
    if (s.name == name && !s.primary) return true;
  return false;
}

at::Tensor Trainer::pipeline_evaluate(const at::Tensor& inputs_BS, const at::Tensor& labels_BS) {
  const int64_t mbs = cfg_.parallelism.pipeline_parallel_microbatch_size;
  const int64_t seq = inputs_BS.size(1);
  const int64_t seq_local = tensor_parallel_ && tensor_parallel_->options().sequence_parallel ? seq / dims_->tp() : seq;
  pipeline_seq_len_ = seq;
  at::Tensor sum = pipeline_->evaluate(
      static_cast<int>(inputs_BS.size(0) / mbs), {mbs, seq_local, model_->hidden_size()},
      [&](int m) { return inputs_BS.narrow(0, m * mbs, mbs); },
      [&](int m, const at::Tensor& logits_BSV) {
        const at::Tensor labels = labels_BS.narrow(0, m * mbs, mbs);
        return parallelized_.loss_sum(logits_BSV.flatten(0, 1), labels.flatten(0, 1)).to(at::kDouble);
      });
  return sum.to(at::kDouble);
}

void Trainer::for_each_full_parameter(const std::function<void(const std::string&, const at::Tensor&)>& f) {
  if (!pipeline_) {
    for (const auto& p : params_) f(p.name, dist::gather_full(p, *mesh_).to(at::kFloat));
    return;
  }
  // Each parameter is gathered over its shard groups by the ranks of its stage, then broadcast
  // from the stage's pp rank to the others, in the whole model's order.
  dist::Group& pp = (*mesh_)["pp"];
  std::map<std::string, const dist::PlacedTensor*> mine;
  for (const auto& p : params_) mine[p.name] = &p;
  for (const auto& item : model_->named_parameters()) {
    const std::string& name = item.key();
    int stage = -1;
    for (size_t s = 0; s < stage_modules_.size() && stage < 0; ++s)
      for (const auto& m : stage_modules_[s])
        if (name.rfind(m + ".", 0) == 0) stage = static_cast<int>(s);
    TITAN_ASSERT(stage >= 0, "parameter ", name, " is in no pipeline stage");
    const int owner = pipeline_->stage_rank(stage);
    at::Tensor full;
    if (owner == pp.rank()) {
      full = dist::gather_full(*mine.at(name), *mesh_).to(mesh_->device(), at::kFloat).contiguous();
    } else {
      full = at::empty(model_->global_shape(name), at::TensorOptions().device(mesh_->device()).dtype(at::kFloat));
    }
    pp.broadcast(full, owner).wait();
    f(name, full);
  }
}

}  // namespace titan
