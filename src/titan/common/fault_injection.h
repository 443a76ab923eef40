// Fault injection for the reliability tests (docs/reliability.md): makes a chosen rank fail at a
// chosen point of a chosen step the way real faults do, so that restart, resume, hang detection and
// the NaN policy can be tested end to end.
//
//   TITAN_FAULT_INJECT="action=kill,point=backward,step=3,rank=1[,attempt=0][;action=...]"
//
//   action   kill: the process sends itself SIGKILL (like kill -9);
//            stop: SIGSTOP (a rank that stops answering, as a hung one does);
//            nan:  the loss of that rank becomes NaN (point loss);
//            oom:  throws the out-of-memory error the CUDA caching allocator throws (c10::OutOfMemoryError),
//                  so the out-of-memory path (its memory snapshot and message) runs on any machine;
//            term: SIGTERM, as a scheduler's preemption notice (handled in the calling thread, so the
//                  step at which it arrives is exact);
//            sleep: the rank pauses `seconds` (default 5) there: a slow step or save.
//   point    data (before the micro-batch is read), forward (after the model's forward), loss,
//            backward (inside backward, before the model's first gradient), optimizer (after the
//            gradient norm, before the update), checkpoint_data (half of a checkpoint file written),
//            checkpoint_index (every file written, no index yet), checkpoint_rename (index written,
//            folder not yet renamed into place). The checkpoint points fire in whichever thread saves
//            (the background one under checkpoint.async_mode).
//   step     the training step (1-based) at which it fires; for checkpoint points, the step saved.
//   rank     the global rank it fires on (default 0), or "any".
//   seconds  how long a sleep lasts.
//   Several entries at one point and step are carried out in the order given.
//   attempt  the restart attempt (TORCHELASTIC_RESTART_COUNT, 0 for the first) it fires in (default
//            0, so that a restarted job does not fail again), or "any".
//
// Without the variable every call is one getenv. A malformed value is a UserError.
#pragma once

#include <cstdint>

namespace titan::fault {

// Parses TITAN_FAULT_INJECT (once); throws UserError when it is malformed. Called at start-up so a
// typo fails before training, not at the step it names.
void check_environment();

// Whether any fault is planned for this rank and attempt.
bool enabled();

// Carries out a planned kill or stop at `point` of step `step`, after one line on stderr naming it.
void point(const char* point, int64_t step);

// Whether the loss of this rank is to become NaN at step `step`.
bool nan_loss(int64_t step);

}  // namespace titan::fault
