// Pipeline parallelism: the interpreter that runs a schedule (pipeline_schedule.h) on this rank's
// stages, moving activations and gradients between neighbouring stages by point-to-point messages
// on the `pp` mesh dimension.
//
// One step runs every action of this rank's order once:
//   F  receives the stage's input (from the rank of the stage before, or from this rank when it
//      holds that stage too), runs the stage's forward, sends the output on (the last stage computes
//      the microbatch's loss instead)
//   B  receives the gradient of the stage's output, back-propagates it (input and weight gradients)
//      and sends the input's gradient back
//   I  the same, computing only the input's gradient (the graph is kept for W)
//   W  the weight gradients of a microbatch whose I has run: autograd runs again from the nodes
//      where the weights' gradient paths leave the input's, with the gradients I captured there, so
//      no gradient on the input path is computed twice (PyTorch's stage_backward_weight)
// Messages follow communication_plan() (pipeline_comm.h): each is posted alone, the send by its
// producer and the receive by its consumer, both in the order messages are produced; an action
// waits for its receives (on CUDA a stream wait: the host goes on), sends complete in the background
// and are waited for at the end of the step. check_schedule() proves that order free of mismatches and
// deadlocks under NCCL's rules (messages between two ranks match in posting order, tags ignored).
// On Gloo every message also has its own tag (kind, stage, microbatch) unless
// TITAN_P2P_ORDER_MATCHED=1 makes Gloo match by order as NCCL does. A rank holds a microbatch's
// activations from its forward to its backward (W for split backwards) only.
#pragma once

#include "titan/distributed/mesh.h"
#include "titan/distributed/pipeline_comm.h"
#include "titan/distributed/pipeline_schedule.h"

#include <ATen/core/Tensor.h>

#include <functional>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

namespace titan::dist {

// A stage this rank holds.
struct PipelineStage {
  int index = 0;  // global stage index
  // The stage's module: input (tokens for the first stage, else the previous stage's output) to
  // output (logits for the last stage).
  std::function<at::Tensor(const at::Tensor& input)> forward;
  // The module's parameters as autograd sees them (the leaves its forward uses), for W.
  std::vector<at::Tensor> parameters;
  // Called after each backward action (B, I or W) of this stage (FSDP reshards its units).
  std::function<void()> after_backward;
};

class PipelineRunner {
 public:
  // order: the schedule of every rank (checked); num_stages over pp.size() ranks; stages: this rank's
  // (those the order gives it). boundary_options: dtype and device of what crosses between stages.
  PipelineRunner(Group& pp, PipelineOrder order, int num_stages, int microbatches, std::vector<PipelineStage> stages,
                 at::TensorOptions boundary_options);
  ~PipelineRunner();

  // Runs one training step's schedule. boundary_shape: one microbatch's hidden states between
  // stages. input(m): the first stage's input of microbatch m (called on the rank holding the first
  // stage); loss(m, logits): the last stage's loss of microbatch m, a scalar scaled as its gradient
  // should be (called on the rank holding the last stage). Returns the sum of the losses on the
  // rank holding the last stage, 0 elsewhere.
  at::Tensor train_step(const std::vector<int64_t>& boundary_shape, const std::function<at::Tensor(int)>& input,
                        const std::function<at::Tensor(int, const at::Tensor&)>& loss);
  // The forwards only of `microbatches` microbatches, without gradients (evaluation): microbatches in
  // order, each through every stage. Otherwise as train_step.
  at::Tensor evaluate(int microbatches, const std::vector<int64_t>& boundary_shape,
                      const std::function<at::Tensor(int)>& input,
                      const std::function<at::Tensor(int, const at::Tensor&)>& loss);

  // Called before each action of train_step runs (e.g. fault injection); empty: nothing.
  std::function<void(const PipeAction&)> before_action;

  int num_stages() const { return num_stages_; }
  int microbatches() const { return microbatches_; }
  int stage_rank(int stage) const { return stage_ranks_.at(stage); }  // index in the pp group
  // Where the last train_step's time went on this rank: computing actions (busy), blocked waiting
  // for a message (the rest of the step is the bubble), and per operation (F, B, I, W) the compute
  // seconds and count, e.g. for simulate_schedule with measured costs.
  struct StepTiming {
    double step_seconds = 0, busy_seconds = 0, wait_seconds = 0;
    std::map<char, std::pair<double, int>> per_op;
  };
  const StepTiming& last_step_timing() const { return timing_; }
  // Split backwards that ran whole in I instead, for a stage or for a checkpointed block in it (a
  // graph where one weight's gradient path reaches another use of it, so W could not start from I's
  // captured gradients); 0 for the models titan ships.
  int64_t weight_pass_fallbacks() const { return weight_fallbacks_; }

  struct MicrobatchState;

 private:
  enum Kind { kActivation = 0, kGradient = 1 };
  // Runs one rank's plan: posts each batch, then computes the step's action with `compute`.
  void execute(const std::vector<PlanStep>& plan, const std::function<void(const PipeAction&)>& compute);
  at::Tensor receive(Kind kind, int stage, int microbatch);  // waits until it has arrived
  void deliver(Kind kind, int stage, int microbatch, const at::Tensor& t);  // to the stage that needs it
  int tag(const PipeMessage& m) const;
  void run(const PipeAction& a, const std::function<at::Tensor(int)>& input,
           const std::function<at::Tensor(int, const at::Tensor&)>& loss, at::Tensor& loss_sum);
  void finish_sends();
  PipelineStage& local(int stage);

  Group& pp_;
  PipelineOrder order_;
  int num_stages_, microbatches_;
  std::vector<int> stage_ranks_;
  std::vector<PipelineStage> stages_;
  std::vector<int64_t> boundary_shape_;  // of the step running
  at::TensorOptions boundary_options_;
  std::map<std::pair<int, int>, std::unique_ptr<MicrobatchState>> state_;  // (stage, microbatch)
  std::map<std::tuple<int, int, int>, at::Tensor> handoff_;  // (kind, stage, microbatch): same-rank deliveries
  std::map<std::tuple<int, int, int>, at::Tensor> outbox_;   // produced for another rank, not yet posted
  struct Posted {
    std::shared_ptr<Work> work;  // the batch it belongs to
    at::Tensor tensor;
  };
  std::map<std::tuple<int, int, int>, Posted> inbox_;  // receives posted, not yet read
  std::vector<Posted> sends_;  // sends in flight, with the tensors they read
  std::vector<PlanStep> plan_;                         // this rank's plan of a training step
  std::map<int, std::vector<PlanStep>> eval_plans_;    // per number of microbatches: evaluate's
  int64_t weight_fallbacks_ = 0;
  StepTiming timing_;
};

}  // namespace titan::dist
