"""PyTorch's pipeline schedules as data, for tests/unit/distributed/pipeline_schedule_test.cpp.

Builds torch.distributed.pipelining's schedule classes over stand-in stages (only the attributes
the schedules read: stage_index, num_stages, group_size, group_rank, submod), no process group,
and prints {"<name> pp=<P> spr=<S> m=<M>": {"<rank>": [cell, ...]}} as JSON: each rank's compute
actions in order, "" for an idle slot, communication actions (REDUCE_GRAD) left out.
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
        out[str(rank)] = [("" if a is None else str(a)) for a in po[rank] if a is None or "REDUCE" not in str(a)]
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
    print(json.dumps(result))


if __name__ == "__main__":
    main()
