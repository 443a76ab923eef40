// Pipeline schedules as data: for every pipeline rank, the ordered list of compute actions it runs
// in one training step. A schedule is generated (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
// InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) or read from a CSV file in PyTorch's
// compute-only format (torchtitan's parallelism.pipeline_parallel_schedule_csv), and checked before
// anything runs: every stage's forward and backward of every microbatch exactly once, each stage on
// one rank, and an order that cannot deadlock (a simulation of all ranks, each waiting for the
// activations and gradients its next action needs).
//
// An action is "<stage><op><microbatch>", e.g. 2F0 (stage 2, forward of microbatch 0):
//   F  forward
//   B  full backward (input and weight gradients)
//   I  backward of the input only (the gradient sent to the previous stage)
//   W  backward of the weights only (after the stage's I of the same microbatch)
// The CSV has one row per rank, one cell per time slot; an empty cell is an idle slot.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace titan::dist {

enum class PipeOp : char { Forward = 'F', Backward = 'B', BackwardInput = 'I', BackwardWeight = 'W' };

struct PipeAction {
  int stage = 0;
  PipeOp op = PipeOp::Forward;
  int microbatch = 0;
  bool operator==(const PipeAction&) const = default;
};

// "2F0".
std::string format_action(const PipeAction& a);
// Parses one cell: nullopt for an empty one (an idle slot); a UserError naming the cell otherwise.
std::optional<PipeAction> parse_action(const std::string& cell);

// rank -> its actions in execution order (idle slots, where a CSV has them, are kept as nullopt).
using PipelineOrder = std::vector<std::vector<std::optional<PipeAction>>>;

// PyTorch's schedules for one stage per rank (ScheduleGPipe, Schedule1F1B), with `pp` ranks and
// `microbatches` microbatches: the same actions in the same order per rank.
PipelineOrder gpipe_order(int pp, int microbatches);
PipelineOrder one_f_one_b_order(int pp, int microbatches);
// Several stages per rank, looped (rank r holds stages r, r + pp, r + 2 pp, ...): PyTorch's
// ScheduleInterleaved1F1B, or with `zero_bubble` its ScheduleInterleavedZeroBubble (backward split into
// I and W, the W of each microbatch deferred to fill the bubbles). The same actions in the same order
// per rank (idle slots are not generated: the order is what runs). Microbatches are taken in rounds
// of max(1, microbatches / pp); microbatches must be a multiple of the number of rounds.
PipelineOrder interleaved_order(int pp, int local_stages, int microbatches, bool zero_bubble);
// Several stages per rank, looped, breadth first: every microbatch's forward through a local stage
// before the next local stage, then the backwards from the last local stage back, each local stage's
// microbatches last to first. PyTorch's ScheduleLoopedBFS, the same actions in the same order per rank.
PipelineOrder looped_bfs_order(int pp, int local_stages, int microbatches);
// Two stages per rank in a V (rank r holds stages r and 2 pp - 1 - r), backward split into I and W:
// PyTorch's ScheduleZBVZeroBubble, the same actions in the same order per rank.
PipelineOrder zbv_order(int pp, int microbatches);
// Two stages per rank in a V: DeepSeek's DualPipeV as PyTorch's ScheduleDualPipeV lays it out, the
// same actions in the same order per rank, each of its overlapped pairs (one stage's forward with the
// other's full backward) written as the forward then the backward. Needs at least 2 pp microbatches.
PipelineOrder dualpipev_order(int pp, int microbatches);

// The schedule named by torchtitan's parallelism.pipeline_parallel_schedule (GPipe, 1F1B,
// Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; case-insensitive) for
// `pp` ranks holding `stages_per_rank` stages each. A name, or a number of stages per rank the
// schedule cannot run (GPipe and 1F1B one, ZBVZeroBubble and DualPipeV two), is a UserError that says
// what to change.
PipelineOrder schedule_by_name(const std::string& name, int pp, int stages_per_rank, int microbatches);

// The time one step of a schedule takes when every action of a kind costs the same and messages
// are free: each rank runs its next action as soon as it is free and what the action needs is done.
struct ActionCosts {
  double forward = 1, backward = 2, backward_input = 1, backward_weight = 1;
};
struct ScheduleTiming {
  double step_time = 0;           // when the last action ends
  std::vector<double> busy;       // per rank: time spent in actions
  std::vector<double> finish;     // per rank: when its last action ends
  // The share of the step a rank spends idle, averaged over ranks: the pipeline bubble.
  double bubble_fraction() const;
};
// Requires a schedule that check_schedule() accepts.
ScheduleTiming simulate_schedule(const PipelineOrder& order, int num_stages, const ActionCosts& costs = {});

// The CSV text of a schedule (one row per rank, comma-separated cells) and its reverse.
std::string schedule_csv(const PipelineOrder& order);
PipelineOrder parse_schedule_csv(const std::string& text, const std::string& source = "<csv>");
PipelineOrder read_schedule_csv(const std::string& path);

// The stage -> rank map a schedule implies, checked: every stage in [0, num_stages) on exactly one
// rank. Throws UserError otherwise.
std::vector<int> stage_ranks(const PipelineOrder& order, int num_stages);

// Checks that `order` runs one step of `num_stages` stages over `microbatches` microbatches: every
// (stage, microbatch) has one forward and either one B or one I and one W; nothing else; and the
// ranks, each running its actions in order and waiting only for what the next one needs (the
// previous stage's forward, the next stage's backward, its own forward before its backward, its
// own I before its W), all finish; and the point-to-point messages the runner posts for it
// (communication_plan, pipeline_comm.h) match and cannot deadlock under NCCL's rules. Throws
// UserError naming the first problem (for a deadlock, what every rank is waiting for; for messages,
// the pair of ranks and the operations).
void check_schedule(const PipelineOrder& order, int num_stages, int microbatches);

}  // namespace titan::dist
