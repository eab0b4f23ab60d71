"""``build_pipeline``: partition, split, shard (through a callback), wrap in stages, pick a schedule.

The sharding is the caller's: ``parallelize_fn(stage_module)`` applies TP / activation
checkpointing / ZeRO to each stage module and returns a handle (the app returns the ZeRO
stage); this package never imports ZeRO or TP, as in torchtitan's ``pipeline_llama``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from deepshard.pipeline.partition import partition_layers
from deepshard.pipeline.schedule import (
    MicrobatchLoss,
    build_schedule,
    default_virtual_stages,
    stage_ids_for_rank,
    validate_pipeline,
)
from deepshard.pipeline.split import DecoderSpec, split_model

__all__ = ["Pipeline", "build_pipeline"]


@dataclass
class Pipeline:
    """This rank's share of the pipeline."""

    modules: list[nn.Module]  # stage modules, in stage order (one, or ``virtual_stages`` of them)
    stages: list[PipelineStage]
    schedule: Any  # a torch.distributed.pipelining schedule
    loss: MicrobatchLoss
    handles: list[Any]  # what parallelize_fn returned for each module
    stage_ids: list[int]
    ranges: list[range]  # layer range of every stage (all ranks)
    pp_mesh: DeviceMesh
    microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.ranges)

    @property
    def has_first(self) -> bool:
        """This rank feeds the inputs (holds stage 0)."""
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        """This rank computes the loss (holds the last stage)."""
        return self.num_stages - 1 in self.stage_ids


def build_pipeline(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    schedule: str = "1f1b",
    microbatches: int = 1,
    partition: str = "uniform",
    virtual_stages: int | None = None,
    parallelize_fn: Callable[[nn.Module], Any] | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    spec: DecoderSpec | None = None,
    device: torch.device | None = None,
) -> Pipeline:
    """Build this rank's stages of ``model`` over ``pp_mesh`` (a 1-D mesh, possibly of size 1).

    ``model``: the full decoder, materialized (weights copied) or on meta (``init_fn`` fills each
    stage after ``to_empty``; see :func:`split_model`).  ``loss_fn(logits, labels)``, the summed
    token loss, runs on the last stage; ``train_step`` feeds ``labels`` as the schedule's target.  ``parallelize_fn`` is
    called once per stage module, after its weights are real and before it is wrapped, and may
    change the module in place (TP, FSDP).  Raises ValueError for an unknown schedule or
    partition, too many stages for the layers, or a microbatch count the schedule cannot run.
    """
    spec = spec or DecoderSpec()
    pp = pp_mesh.size()
    virtual_stages = default_virtual_stages(schedule) if virtual_stages is None else virtual_stages
    layers = getattr(model, spec.layers)
    validate_pipeline(schedule=schedule, pp=pp, microbatches=microbatches, virtual_stages=virtual_stages,
                      num_layers=len(layers), partition=partition)
    num_stages = pp * virtual_stages
    ranges = partition_layers(list(layers), num_stages, partition,
                              first_extra=[getattr(model, n) for n in spec.first],
                              last_extra=[getattr(model, n) for n in spec.last])
    stage_ids = stage_ids_for_rank(pp_mesh.get_local_rank(), pp, virtual_stages)
    device = device or torch.device("cpu")
    modules = split_model(model, ranges, stage_ids, spec=spec, device=device, init_fn=init_fn)
    handles = [parallelize_fn(m) if parallelize_fn is not None else None for m in modules]
    group = pp_mesh.get_group()
    stages = [PipelineStage(m, sid, num_stages, device, group=group) for m, sid in zip(modules, stage_ids)]
    loss = MicrobatchLoss(loss_fn, microbatches)
    sched = build_schedule(schedule, stages, microbatches, loss)
    return Pipeline(modules=modules, stages=stages, schedule=sched, loss=loss, handles=handles,
                    stage_ids=stage_ids, ranges=ranges, pp_mesh=pp_mesh, microbatches=microbatches)
