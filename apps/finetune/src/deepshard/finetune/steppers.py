"""One optimizer step of the run, over the two ways a model is parallelized.

``EngineStepper``: data parallel only (ZeRO 0-3 through ``deepshard.core.initialize``), gradient
accumulation over ``train.grad_accum`` micro-batches.  ``PipelineStepper``: pipeline and/or tensor
parallel (``parallel.pp`` / ``parallel.tp`` > 1) through ``deepshard.pipeline``; its micro-batches
are the pipeline's (``pipeline.microbatches``).  The loop in train.py sees one interface.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from deepshard.core.memory import ModelStateBytes
from deepshard.core.optim import StepStats
from deepshard.finetune.evaluate import IGNORE, model_inputs


@dataclass
class StepOutput:
    loss: float  # the step's summed token loss / its global valid-token count, identical on every rank
    stats: StepStats
    memory: ModelStateBytes | None  # measured model-state bytes after backward, when asked


class EngineStepper:
    """Per step: count the valid label tokens of all its micro-batches (one all-reduce over dp), then
    ``engine(batch, reduction="sum")`` and ``engine.backward(loss_sum, num_items=count)`` per micro-batch,
    then ``engine.step()``: the step's loss is the sum of token losses over the global batch divided by
    the global valid-token count, whatever the micro-batch and rank layout (the README's "The loss of a step")."""

    def __init__(self, engine, *, grad_accum: int, device: torch.device) -> None:
        self.engine = engine
        self.grad_accum = grad_accum
        self.device = device
        self.prof = None  # the run's StepProfiler, set once the engine exists
        self.dp_group = engine.mesh["dp"].get_group()

    def __call__(self, batches: Iterator[dict], *, measure_memory: bool = False) -> StepOutput:
        micro_batches = [next(batches) for _ in range(self.grad_accum)]
        num_items = self.engine.global_num_items(sum(valid_tokens(b["labels"]) for b in micro_batches))
        total = torch.zeros((), device=self.device)
        for batch in micro_batches:
            args, kwargs = model_inputs(batch, self.device)
            with self.prof.phase("forward"):
                loss_sum = self.engine(*args, **kwargs, reduction="sum")
            total += loss_sum.detach().float()
            with self.prof.phase("backward"):
                self.engine.backward(loss_sum, num_items=num_items)
        memory = self.engine.memory()["measured"] if measure_memory else None
        with self.prof.phase("optimizer"):
            stats = self.engine.step()
        dist.all_reduce(total, group=self.dp_group)
        return StepOutput((total / num_items.clamp(min=1.0)).item(), stats, memory)


def valid_tokens(labels: torch.Tensor) -> int:
    """Label positions that count in the loss (labels != -100)."""
    return int((labels != IGNORE).sum())


class PipelineStepper:
    """``pipeline.microbatches`` micro-batches stacked into one batch for the schedule."""

    def __init__(self, trainer, mesh: DeviceMesh, *, microbatches: int, device: torch.device) -> None:
        self.engine = self.trainer = trainer  # a deepshard.core Trainer, as the engine is
        self.microbatches = microbatches
        self.device = device
        self.prof = None

    def __call__(self, batches: Iterator[dict], *, measure_memory: bool = False) -> StepOutput:
        parts = [next(batches) for _ in range(self.microbatches)]
        ids = torch.cat([p["input_ids"] for p in parts]).to(self.device)
        labels = torch.cat([p["labels"] for p in parts]).to(self.device)
        with self.prof.phase("forward"):  # forward, backward and the step run inside the schedule
            result = self.trainer.train_step(ids, labels)
        memory = None
        if measure_memory:  # after the step the grads are gone: count them as the stage holds them
            memory = self.trainer.memory()["measured"]
        return StepOutput(result.loss, result.stats, memory)
