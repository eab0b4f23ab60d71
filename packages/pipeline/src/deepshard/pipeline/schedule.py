"""Schedules by name, their constraints, and which stages each pp rank holds.

| name             | torch class                   | stages per rank | microbatches          |
|------------------|-------------------------------|-----------------|-----------------------|
| gpipe            | ScheduleGPipe                 | 1               | any >= 1              |
| 1f1b             | Schedule1F1B                  | 1               | >= pp                 |
| interleaved_1f1b | ScheduleInterleaved1F1B       | virtual (2)     | a multiple of pp      |
| zero_bubble      | ScheduleInterleavedZeroBubble | virtual (2)     | a multiple of pp      |

Multi-stage schedules place stages round-robin ("loop" style): rank r holds r, r+pp, r+2pp, ...
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from deepshard.pipeline.partition import check_method

__all__ = ["SCHEDULES", "MicrobatchLoss", "build_schedule", "stage_ids_for_rank", "validate_pipeline"]

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble")


def default_virtual_stages(schedule: str) -> int:
    """Stages per rank when the caller does not say: 2 for the interleaved schedules, else 1."""
    return 2 if schedule in MULTI_STAGE else 1


def validate_pipeline(*, schedule: str, pp: int, microbatches: int, virtual_stages: int, num_layers: int,
                      partition: str = "uniform") -> None:
    """Every pipeline setting a run could get wrong, checked before any process group work
    (the app can call it while validating its config)."""
    check_method(partition)
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline.schedule={schedule!r}: valid values are {sorted(SCHEDULES)}")
    if microbatches < 1:
        raise ValueError(f"pipeline.microbatches={microbatches}: must be >= 1")
    if virtual_stages < 1:
        raise ValueError(f"pipeline.virtual_stages={virtual_stages}: must be >= 1")
    if schedule not in MULTI_STAGE and virtual_stages != 1:
        raise ValueError(f"pipeline.virtual_stages={virtual_stages} with pipeline.schedule={schedule!r}: "
                         f"only {list(MULTI_STAGE)} hold several stages per rank; use 1")
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(f"pipeline.microbatches={microbatches} with pipeline.schedule='1f1b': must be >= "
                         f"parallel.pp={pp} (otherwise the pipeline never fills)")
    if schedule in MULTI_STAGE and microbatches % pp:
        raise ValueError(f"pipeline.microbatches={microbatches} with pipeline.schedule={schedule!r}: must be a "
                         f"multiple of parallel.pp={pp}")
    if pp * virtual_stages > num_layers:
        raise ValueError(f"parallel.pp={pp} x pipeline.virtual_stages={virtual_stages} = {pp * virtual_stages} "
                         f"stages > model.n_layers={num_layers}: every stage needs at least one layer")


def stage_ids_for_rank(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The global stage indices ``pp_rank`` holds, loop style."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


class MicrobatchLoss:
    """The schedule's ``loss_fn``: ``loss_fn(output, target) * multiplier``.

    ``loss_fn`` returns a microbatch's *summed* token loss; the pipeline engine sets ``multiplier`` each step
    to ``loss_scale * dp / global_num_items`` (the fp16 loss scale, times dp because the ZeRO
    reducers average over data-parallel ranks, over the step's valid-token count across every
    microbatch and dp rank).  So the gradient is that of the global batch's token-weighted mean,
    whatever the microbatch layout, and gradients already reduced during backward (ZeRO-2's
    reduce-scatter) come out right too (the schedule's own ``scale_grads`` stays off).
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], microbatches: int) -> None:
        self.loss_fn = loss_fn
        self.microbatches = microbatches
        self.multiplier: torch.Tensor | float = 1.0

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * self.multiplier

    def true_sum(self, scaled: list[torch.Tensor]) -> torch.Tensor:
        """This rank's summed token loss from the schedule's per-microbatch (multiplied) losses."""
        return torch.stack([t.detach().float() for t in scaled]).sum() / self.multiplier


def build_schedule(name: str, stages: list[PipelineStage], microbatches: int, loss: MicrobatchLoss):
    """The torch schedule object for ``name`` over this rank's ``stages``."""
    cls = SCHEDULES[name]
    if name in MULTI_STAGE:
        return cls(stages, n_microbatches=microbatches, loss_fn=loss, scale_grads=False)
    assert len(stages) == 1, "single-stage schedules hold one stage per rank"
    return cls(stages[0], n_microbatches=microbatches, loss_fn=loss, scale_grads=False)
