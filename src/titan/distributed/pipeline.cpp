#include "titan/distributed/pipeline.h"

#include "titan/common/error.h"
#include "titan/common/trace.h"
#include "titan/nn/split_backward.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <optional>
#include <set>

namespace titan::dist {

using torch::autograd::variable_list;

// One microbatch on one stage, from its forward to the end of its backward.
struct PipelineRunner::MicrobatchState {
  at::Tensor input;     // a leaf requiring grad (not on the first stage)
  at::Tensor output;    // the stage's output, or the loss on the last stage
  at::Tensor grad_out;  // the gradient of `output` (undefined for the loss)
  std::unique_ptr<nn::WeightPass> weights;         // W: from the gradients captured during I
  std::vector<std::function<void()>> deferred;     // W of checkpointed blocks recomputed during I
  bool whole_backward_done = false;                // I ran the whole backward (no split possible)
  bool input_done = false;                         // I has run
};

PipelineRunner::PipelineRunner(Group& pp, PipelineOrder order, int num_stages, int microbatches,
                               std::vector<PipelineStage> stages, at::TensorOptions boundary_options)
    : pp_(pp), order_(std::move(order)), num_stages_(num_stages), microbatches_(microbatches),
      stages_(std::move(stages)), boundary_options_(boundary_options) {
  TITAN_ASSERT(static_cast<int>(order_.size()) == pp_.size(), "pipeline order for ", order_.size(), " ranks, the pp group has ",
               pp_.size());
  check_schedule(order_, num_stages_, microbatches_);
  stage_ranks_ = stage_ranks(order_, num_stages_);
  plan_ = communication_plan(order_, num_stages_).at(pp_.rank());
  std::set<int> mine;
  for (const auto& a : order_[pp_.rank()])
    if (a) mine.insert(a->stage);
  std::set<int> given;
  for (const auto& s : stages_) given.insert(s.index);
  TITAN_ASSERT(mine == given, "the pipeline schedule gives this rank other stages than it built");
}

PipelineRunner::~PipelineRunner() = default;

PipelineStage& PipelineRunner::local(int stage) {
  for (auto& s : stages_)
    if (s.index == stage) return s;
  TITAN_ASSERT(false, "stage ", stage, " is not on this rank");
  return stages_.front();
}

int PipelineRunner::tag(const PipeMessage& m) const {
  return (m.microbatch * 2 + (m.gradient ? 1 : 0)) * num_stages_ + m.stage;
}

void PipelineRunner::execute(const std::vector<PlanStep>& plan, const std::function<void(const PipeAction&)>& compute) {
  for (const auto& step : plan) {
    for (const P2POp& op : step.ops) {
      const auto key = std::make_tuple(op.message.gradient ? kGradient : kActivation, op.message.stage, op.message.microbatch);
      if (!op.send) {
        at::Tensor buf = at::empty(boundary_shape_, boundary_options_);
        inbox_[key] = Posted{std::make_shared<Work>(pp_.recv(buf, op.peer, tag(op.message))), buf};
        continue;
      }
      auto it = outbox_.find(key);
      TITAN_ASSERT(it != outbox_.end(), "pipeline: the ", format_message(op.message), " was not produced before its send");
      // Sends that have completed release their tensors now, not at the end of the step.
      for (auto done = sends_.begin(); done != sends_.end();) {
        if (!done->work->completed()) {
          ++done;
          continue;
        }
        done->work->wait();  // rethrows a failure
        done = sends_.erase(done);
      }
      at::Tensor msg = std::move(it->second);
      outbox_.erase(it);
      sends_.push_back(Posted{std::make_shared<Work>(pp_.send(msg, op.peer, tag(op.message))), msg});
    }
    if (step.action) compute(*step.action);
  }
  finish_sends();
}

at::Tensor PipelineRunner::receive(Kind kind, int stage, int microbatch) {
  // An activation comes from the stage before, a gradient from the stage after.
  const int from = kind == kActivation ? stage - 1 : stage + 1;
  if (stage_ranks_[from] == pp_.rank()) {
    auto it = handoff_.find({kind, stage, microbatch});
    TITAN_ASSERT(it != handoff_.end(), "pipeline: stage ", from, " has not produced what stage ", stage, " needs");
    at::Tensor t = std::move(it->second);
    handoff_.erase(it);
    return t;
  }
  auto posted = inbox_.find({kind, stage, microbatch});
  TITAN_ASSERT(posted != inbox_.end(), "pipeline: no receive was posted for stage ", stage, " microbatch ", microbatch);
  const auto start = std::chrono::steady_clock::now();
  posted->second.work->wait();  // every handle of the batch: a no-op once one has waited
  timing_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  at::Tensor buf = std::move(posted->second.tensor);
  inbox_.erase(posted);
  return buf;
}

void PipelineRunner::deliver(Kind kind, int stage, int microbatch, const at::Tensor& t) {
  TITAN_ASSERT(t.sizes() == c10::IntArrayRef(boundary_shape_) && t.scalar_type() == boundary_options_.dtype(),
               "pipeline: stage ", kind == kActivation ? stage - 1 : stage + 1, " produced ", t.sizes(), " ",
               t.scalar_type(), " where ", c10::IntArrayRef(boundary_shape_), " ", boundary_options_.dtype(),
               " crosses between stages");
  at::Tensor msg = t.detach().contiguous();
  if (stage_ranks_[stage] == pp_.rank()) {
    handoff_[{kind, stage, microbatch}] = msg;
    return;
  }
  outbox_[{kind, stage, microbatch}] = msg;  // sent with the next batch to that rank (the plan's order)
}

void PipelineRunner::finish_sends() {
  for (auto& s : sends_) s.work->wait();
  sends_.clear();
}

void PipelineRunner::run(const PipeAction& a, const std::function<at::Tensor(int)>& input,
                         const std::function<at::Tensor(int, const at::Tensor&)>& loss, at::Tensor& loss_sum) {
  PipelineStage& stage = local(a.stage);
  const bool first = a.stage == 0, last = a.stage == num_stages_ - 1;
  const std::string label = format_action(a);
  auto key = std::make_pair(a.stage, a.microbatch);
  if (a.op == PipeOp::Forward) {
    TraceRange range(mem::Phase::Forward, "pipeline ", label);
    auto st = std::make_unique<MicrobatchState>();
    at::Tensor in = first ? input(a.microbatch) : receive(kActivation, a.stage, a.microbatch).requires_grad_(true);
    at::Tensor out = stage.forward(in);
    if (last) {
      out = loss(a.microbatch, out);
      loss_sum = loss_sum.defined() ? loss_sum + out.detach() : out.detach();
    } else {
      deliver(kActivation, a.stage + 1, a.microbatch, out);
    }
    st->input = first ? at::Tensor() : in;
    st->output = out;
    state_[key] = std::move(st);
    return;
  }
  auto it = state_.find(key);
  TITAN_ASSERT(it != state_.end(), "pipeline: ", label, " before the forward of its microbatch");
  MicrobatchState& st = *it->second;
  TraceRange range(mem::Phase::Backward, "pipeline ", label);
  if (!st.input_done && !last) st.grad_out = receive(kGradient, a.stage, a.microbatch);
  const variable_list grad_out = last ? variable_list{} : variable_list{st.grad_out};
  if (a.op == PipeOp::Backward) {
    torch::autograd::backward({st.output}, grad_out);
    if (!first) deliver(kGradient, a.stage - 1, a.microbatch, st.input.grad());
    state_.erase(it);
  } else if (a.op == PipeOp::BackwardInput) {
    st.input_done = true;
    if (!first) {  // the first stage's input needs no gradient: W runs its whole backward
      st.weights = nn::WeightPass::plan(st.output, {st.input}, stage.parameters);
      at::Tensor g;
      if (st.weights) {
        // Checkpointed blocks recompute their bodies here and leave their weights to W.
        nn::DeferWeights defer;
        g = torch::autograd::grad({st.output}, {st.input}, grad_out, /*retain_graph=*/true,
                                  /*create_graph=*/false, /*allow_unused=*/true)[0];
        st.deferred = defer.take();
        weight_fallbacks_ += defer.whole_backwards();
      } else {
        // The split would compute a gradient twice: the whole backward runs here, W has nothing left.
        ++weight_fallbacks_;
        st.whole_backward_done = true;
        torch::autograd::backward({st.output}, grad_out);
        g = st.input.grad();
      }
      deliver(kGradient, a.stage - 1, a.microbatch, g.defined() ? g : at::zeros_like(st.input));
    }
  } else {  // W
    TITAN_ASSERT(st.input_done, "pipeline: ", label, " before the I of its microbatch");
    if (first) {
      torch::autograd::backward({st.output}, grad_out);
    } else if (st.whole_backward_done) {
      // The weights' gradients came with I.
    } else {
      st.weights->run();
      for (auto& pass : st.deferred) pass();
    }
    state_.erase(it);
  }
  if (stage.after_backward) stage.after_backward();
}

at::Tensor PipelineRunner::train_step(const std::vector<int64_t>& boundary_shape,
                                      const std::function<at::Tensor(int)>& input,
                                      const std::function<at::Tensor(int, const at::Tensor&)>& loss) {
  boundary_shape_ = boundary_shape;
  timing_ = StepTiming();
  using Clock = std::chrono::steady_clock;
  const auto step_start = Clock::now();
  at::Tensor loss_sum;
  execute(plan_, [&](const PipeAction& a) {
    if (before_action) before_action(a);
    const auto start = Clock::now();
    const double waited = timing_.wait_seconds;
    run(a, input, loss, loss_sum);
    const double busy = std::chrono::duration<double>(Clock::now() - start).count() - (timing_.wait_seconds - waited);
    timing_.busy_seconds += busy;
    auto& op = timing_.per_op[static_cast<char>(a.op)];
    op.first += busy;
    op.second += 1;
  });
  timing_.step_seconds = std::chrono::duration<double>(Clock::now() - step_start).count();
  TITAN_ASSERT(state_.empty() && handoff_.empty() && inbox_.empty() && outbox_.empty(), "pipeline: the step left ",
               state_.size(), " microbatch states and ", handoff_.size() + inbox_.size() + outbox_.size(),
               " messages behind");
  return loss_sum.defined() ? loss_sum : at::zeros({}, boundary_options_.dtype(at::kFloat));
}

at::Tensor PipelineRunner::evaluate(int microbatches, const std::vector<int64_t>& boundary_shape,
                                    const std::function<at::Tensor(int)>& input,
                                    const std::function<at::Tensor(int, const at::Tensor&)>& loss) {
  at::NoGradGuard no_grad;
  boundary_shape_ = boundary_shape;
  auto cached = eval_plans_.find(microbatches);
  if (cached == eval_plans_.end()) {
    // Microbatch by microbatch, each through every rank's stages in order: every message an action
    // waits for comes from an earlier (microbatch, stage), and the messages' order is checked as a
    // training step's is.
    PipelineOrder order(pp_.size());
    for (int m = 0; m < microbatches; ++m)
      for (int s = 0; s < num_stages_; ++s) order[stage_ranks_[s]].push_back(PipeAction{s, PipeOp::Forward, m});
    const CommPlan plan = communication_plan(order, num_stages_);
    check_order_matching(plan);
    cached = eval_plans_.emplace(microbatches, plan.at(pp_.rank())).first;
  }
  at::Tensor loss_sum;
  execute(cached->second, [&](const PipeAction& a) {
    TraceRange range(mem::Phase::Validation, "pipeline ", format_action(a));
    const int s = a.stage, m = a.microbatch;
    at::Tensor in = s == 0 ? input(m) : receive(kActivation, s, m);
    at::Tensor out = local(s).forward(in);
    if (s == num_stages_ - 1) {
      at::Tensor l = loss(m, out);
      loss_sum = loss_sum.defined() ? loss_sum + l : l;
    } else {
      deliver(kActivation, s + 1, m, out);
    }
  });
  return loss_sum.defined() ? loss_sum : at::zeros({}, boundary_options_.dtype(at::kFloat));
}

}  // namespace titan::dist
