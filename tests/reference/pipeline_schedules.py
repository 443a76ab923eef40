"""PyTorch's pipeline schedules as data, for tests/unit/distributed/pipeline_schedule_test.cpp.

Builds torch.distributed.pipelining's schedule classes over stand-in stages (only the attributes
the schedules read: stage_index, num_stages, group_size, group_rank, submod), no process group,
and prints {"<name> pp=<P> spr=<S> m=<M>": {"<rank>": [cell, ...]}} as JSON: each rank's compute
actions in order, "" for an idle slot, communication actions (REDUCE_GRAD) left out. DualPipeV's
overlapped forward + backward (OVERLAP_F_B) is written as its two actions in the order PyTorch's
runtime runs them (the forward, then the backward).
"""
import json

import torch
import torch.distributed.pipelining.schedules as S
from torch.distributed.pipelining.stage import _PipelineStageBase


class _Stage(_PipelineStageBase):
    def _create_grad_recv_info(self, *args, **kwargs):
        pass

    def _prepare_forward_infra(self, *args, **kwargs):
        pass


def _stage(index, num_stages, pp, rank):
    s = object.__new__(_Stage)  # no __init__: nothing is built or communicated
    s.stage_index, s.num_stages, s.group_size, s.group_rank = index, num_stages, pp, rank
    s.submod = torch.nn.Identity()
    return s


def order(cls, pp, spr, m, v_shape=False):
    n = pp * spr
    out = {}
    for rank in range(pp):
        indices = [rank, n - 1 - rank] if v_shape else [rank + k * pp for k in range(spr)]
        stages = [_stage(i, n, pp, rank) for i in indices]
        schedule = cls(stages[0], m) if spr == 1 else cls(stages, m)
        po = schedule.pipeline_order if hasattr(schedule, "pipeline_order") else schedule._get_pipeline_order()
        cells = []
        for a in po[rank]:
            if a is None:
                cells.append("")
            elif getattr(a, "sub_actions", None):
                cells.extend(str(sub) for sub in a.sub_actions)
            elif "REDUCE" not in str(a):
                cells.append(str(a))
        out[str(rank)] = cells
    return out


def main():
    result = {}
    for pp in (2, 4):
        for m in (4, 8):
            result[f"GPipe pp={pp} spr=1 m={m}"] = order(S.ScheduleGPipe, pp, 1, m)
            result[f"1F1B pp={pp} spr=1 m={m}"] = order(S.Schedule1F1B, pp, 1, m)
            result[f"Interleaved1F1B pp={pp} spr=2 m={m}"] = order(S.ScheduleInterleaved1F1B, pp, 2, m)
            result[f"InterleavedZeroBubble pp={pp} spr=2 m={m}"] = order(S.ScheduleInterleavedZeroBubble, pp, 2, m)
            result[f"ZBVZeroBubble pp={pp} spr=2 m={m}"] = order(S.ScheduleZBVZeroBubble, pp, 2, m, v_shape=True)
            result[f"LoopedBFS pp={pp} spr=2 m={m}"] = order(S.ScheduleLoopedBFS, pp, 2, m)
            if m >= 2 * pp:  # DualPipeV refuses fewer microbatches than stages
                result[f"DualPipeV pp={pp} spr=2 m={m}"] = order(S.ScheduleDualPipeV, pp, 2, m, v_shape=True)
    for pp, m in ((1, 2), (1, 5), (3, 6), (3, 7), (3, 11)):
        result[f"DualPipeV pp={pp} spr=2 m={m}"] = order(S.ScheduleDualPipeV, pp, 2, m, v_shape=True)
    for pp, spr, m in ((3, 3, 5), (1, 3, 2)):
        result[f"LoopedBFS pp={pp} spr={spr} m={m}"] = order(S.ScheduleLoopedBFS, pp, spr, m)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
