// The point-to-point messages of one pipeline step: in which order each rank posts them, and a
// proof that the order is safe under NCCL's rules.
//
// NCCL's rules, as the check models them (tags play no part):
//   - between two ranks, the k-th send from A to B is received by B's k-th receive from A;
//   - a rank's sends and receives with one peer run in posting order on one stream: an operation
//     starts when the one posted before it with that peer has completed, so a receive waiting for
//     its message blocks a send posted after it to the same peer;
//   - a send completes only when its receive runs (a rendezvous: true of every message larger than
//     NCCL's buffers, so assumed of all);
//   - an operation waits for the computation posted before it on the rank (ProcessGroupNCCL makes
//     its stream wait for the compute stream), and a computation waits for the receives it reads.
// Every message is posted alone: ProcessGroupNCCL runs a lone send or receive on the pair's own
// two-rank communicator (one stream per pair, the FIFO above), but a coalesced group
// (batch_isend_irecv) on the whole group's communicator, so a pair whose two sides grouped their
// messages differently would split one ordered stream of messages over two communicators.
//
// The plan (PyTorch's pipelining runtime builds its sends and receives the same way): the ranks'
// orders are replayed in lockstep, each rank running its next action once what it reads is done.
// When an action produces an activation or gradient for a stage on another rank, the producer posts
// the send and the consumer the receive, each before its own next action: so for every pair of
// ranks both sides post their messages in one order, the order they are produced in (PyTorch's
// pipelining runtime, _add_send_recv, places them the same way). A receive may thus be posted some
// actions before the one that reads it; that action waits for it. Stages held by one rank hand
// tensors over without messages.
#pragma once

#include "titan/distributed/pipeline_schedule.h"

#include <optional>
#include <string>
#include <vector>

namespace titan::dist {

// An activation that stage `stage` - 1 sends into `stage`, or a gradient that stage `stage` + 1
// sends back into `stage`, of one microbatch.
struct PipeMessage {
  bool gradient = false;
  int stage = 0;  // the stage that receives it
  int microbatch = 0;
  bool operator==(const PipeMessage&) const = default;
  int from_stage() const { return gradient ? stage + 1 : stage - 1; }
};
// "activation 1F3 (stage 0 -> 1)", "gradient of 1B3 (stage 2 -> 1)".
std::string format_message(const PipeMessage& m);

struct P2POp {
  bool send = false;
  int peer = 0;  // pipeline rank
  PipeMessage message;
};

// One step of a rank's plan: post `ops`, each alone and in this order, then run `action` (none
// after the last action: the final sends).
struct PlanStep {
  std::vector<P2POp> ops;
  std::optional<PipeAction> action;
};
using CommPlan = std::vector<std::vector<PlanStep>>;  // per pipeline rank

// The plan of every rank for `order` (checked by check_schedule's structural part).
CommPlan communication_plan(const PipelineOrder& order, int num_stages);

// Runs `plan` under NCCL's rules (above). Throws UserError when two ranks disagree on what their
// k-th message is (naming the pair, the position and both messages) or when the ranks deadlock
// (naming, for every blocked pair, what each side waits in).
void check_order_matching(const CommPlan& plan);

}  // namespace titan::dist
