"""The run's steps over either training engine: one protocol, so the loop never asks which it holds.

``EngineStepper``: ZeRO 0-3 and tensor parallelism through ``deepshard.core.initialize``, gradient
accumulation over ``train.grad_accum`` micro-batches.  ``PipelineStepper``: pipeline parallelism
(``parallel.pp`` > 1, with dp and tp) through ``deepshard.pipeline``; a step runs
``pipeline.microbatches x train.grad_accum`` micro-batches through one schedule.  Both offer the
same calls: ``stepper(batches)`` (one optimizer step), ``loss_sum(batch)`` (forward only, for
evaluation), ``next_token(ids)`` (greedy decoding, for the end-of-run sample), and
``rows_per_forward`` (how many rows ``loss_sum`` takes at once); ``engine.memory()`` for the census;
``step_counts()`` (the positions the last step computed, over every dp rank: tokens/s and MFU).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from deepshard.core.memory import ModelStateBytes
from deepshard.core.mesh import axis_size, zero_mesh
from deepshard.core.optim import StepStats
from deepshard.core.sequence_parallel import shard_sequence
from deepshard.core.step import eval_mode, local_valid_tokens, token_mean


@dataclass
class StepOutput:
    loss: float  # the step's summed token loss / its global valid-token count, identical on every rank
    stats: StepStats
    memory: ModelStateBytes | None = None  # measured model-state bytes after backward, when asked
    tokens: int = 0  # positions the step computed over every dp rank (step_counts)
    flops: int = 0  # this rank's model FLOPs of the step (recipe/mfu.py's StepFlops)


def computed_positions(batches: list[dict[str, torch.Tensor]], *, sp_size: int = 1) -> tuple[int, int]:
    """(positions, attended) of this rank's micro-batches: rows x length of each batch as collated (the
    padding inside a batch is computed and counts; what ``data.pad_to_multiple_of`` cut is not), and
    the sum of rows x length x the whole row's length (attention's PaLM term).  Under sequence
    parallelism a batch is this rank's slice of rows ``sp_size`` times as long."""
    positions = attended = 0
    for b in batches:
        rows, length = b["input_ids"].shape[:2]
        positions += rows * length
        attended += rows * length * length * sp_size
    return positions, attended


class _Stepper:
    """What both steppers share: the optimizer step of the engine they hold (``engine``), and one whole
    step for callers outside the loop (tests, benches); the loop calls the two halves itself."""

    engine: Any
    prof: Any

    def step_counts(self) -> tuple[int, int]:
        """(positions, attended) of the last ``forward_backward`` summed over the dp ranks
        (:func:`computed_positions`): identical on every rank."""
        raise NotImplementedError

    def forward_backward(self, batches: Iterator[dict]) -> torch.Tensor:
        raise NotImplementedError

    def step(self) -> StepStats:
        with self.prof.phase("optimizer"):
            return self.engine.step()

    def __call__(self, batches: Iterator[dict]) -> StepOutput:
        loss = self.forward_backward(batches)
        return StepOutput(loss.item(), self.step())


class EngineStepper(_Stepper):
    """Per step: count the valid label tokens of all its micro-batches (one all-reduce over dp), then
    ``engine(batch, reduction="sum")`` and ``engine.backward(loss_sum, num_items=count)`` per micro-batch,
    then ``engine.step()``: the step's loss is the sum of token losses over the global batch divided by
    the global valid-token count, whatever the micro-batch and rank layout (the README's "The loss of a step").
    The positions the step computed ride in the loss's all-reduce (float64: exact to 2^53), so counting
    them adds no collective.

    With sequence parallelism (an ``sp`` axis > 1 on the engine's mesh) every sp rank of a dp rank
    receives the same rows and keeps its consecutive slice of each (``input_ids``, ``labels``,
    ``doc_ids`` alike: the labels were aligned on the whole row); the count and the loss are summed
    over ``dp x sp``."""

    def __init__(self, engine, *, grad_accum: int, device: torch.device, micro_batch_size: int = 1) -> None:
        self.engine = engine
        self.grad_accum = grad_accum
        self.device = device
        self.rows_per_forward = micro_batch_size
        self.prof = None  # the run's StepProfiler, set once the engine exists
        self.dp_group = zero_mesh(engine.mesh).get_group()  # dp, or dp x sp: every rank's part of the loss
        self.sp_size = axis_size(engine.mesh, "sp")
        self.sp_rank = engine.mesh["sp"].get_local_rank() if self.sp_size > 1 else 0
        self.sp_group = engine.mesh["sp"].get_group() if self.sp_size > 1 else None
        self._counts: torch.Tensor | None = None  # the last step's (positions, attended), all dp ranks

    def _mine(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This sp rank's slice of the sequence dimension of every row (the batch itself at sp=1)."""
        if self.sp_size == 1:
            return batch
        return {k: shard_sequence(v, self.sp_rank, self.sp_size) if k in _SEQUENCE_KEYS else v
                for k, v in batch.items()}

    def forward_backward(self, batches: Iterator[dict]) -> torch.Tensor:
        """``grad_accum`` micro-batches' forward and backward; returns the step's loss on every rank."""
        micro_batches = [self._mine(next(batches)) for _ in range(self.grad_accum)]
        num_items = self.engine.global_num_items(local_valid_tokens(b["labels"] for b in micro_batches))
        total = torch.zeros((), device=self.device)
        for batch in micro_batches:
            args, kwargs = model_inputs(batch, self.device)
            with self.prof.phase("forward"):
                loss_sum = self.engine(*args, **kwargs, reduction="sum")
            total += loss_sum.detach().float()
            with self.prof.phase("backward"):
                self.engine.backward(loss_sum, num_items=num_items)
        # one all-reduce for the loss and the counts; the loss is summed in fp32 on each rank as before
        packed = torch.tensor([0.0, *computed_positions(micro_batches, sp_size=self.sp_size)],
                              dtype=torch.float64, device=self.device)
        packed[0] = total
        dist.all_reduce(packed, group=self.dp_group)
        self._counts = packed[1:]
        return token_mean(packed[0].float(), num_items)

    def step_counts(self) -> tuple[int, int]:
        assert self._counts is not None, "step_counts() before the first forward_backward"
        positions, attended = self._counts.tolist()
        return int(positions), int(attended)

    @torch.no_grad()
    def loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This rank's summed token loss over the batch (forward only, the model in eval mode); with
        sequence parallelism, over the whole rows (the sp ranks' slices summed)."""
        args, kwargs = model_inputs(self._mine(batch), self.device)
        with eval_mode(self.engine.model):
            loss = self.engine(*args, **kwargs, reduction="sum").detach().float()
        if self.sp_group is not None:
            dist.all_reduce(loss, group=self.sp_group)
        return loss

    @torch.no_grad()
    def next_token(self, ids: list[int], *, max_seq_len: int) -> int:
        """The greedy next token after ``ids`` (its last ``max_seq_len``), rank 0's on every rank."""
        n = self.sp_size
        context = ids[-(max_seq_len // n * n):]
        # sp: padded on the right to a multiple of sp (causal: nothing before the padding changes)
        row = torch.tensor([context + [0] * (-len(context) % n)], device=self.device)
        with eval_mode(self.engine.model):
            logits = self.engine.model(self._mine({"input_ids": row})["input_ids"])
        if hasattr(logits, "full_tensor"):  # a DTensor (tensor-parallel head)
            logits = logits.full_tensor()
        if self.sp_group is not None:  # the whole row's logits, to pick its last real position
            parts = [torch.empty_like(logits) for _ in range(n)]
            dist.all_gather(parts, logits.contiguous(), group=self.sp_group)
            logits = torch.cat(parts, dim=1)
        token = logits[0, len(context) - 1].float().argmax().reshape(1)
        if dist.is_initialized():
            dist.broadcast(token, src=0)
        return int(token)


_SEQUENCE_KEYS = ("input_ids", "labels", "doc_ids")  # [rows, seq]: what sequence parallelism slices


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device) -> tuple[tuple, dict]:
    """Positional (input_ids, labels) and, for packed rows, ``doc_ids`` (attention within documents)."""
    args = (batch["input_ids"].to(device), batch["labels"].to(device))
    return args, ({"doc_ids": batch["doc_ids"].to(device)} if "doc_ids" in batch else {})


class PipelineStepper(_Stepper):
    """A step stacks ``microbatches`` micro-batches (``pipeline.microbatches x train.grad_accum``) into
    one batch for the schedule; ``doc_ids`` ride along to every stage."""

    def __init__(self, engine, mesh: DeviceMesh, *, microbatches: int, device: torch.device,
                 micro_batch_size: int = 1, seq_len: int | None = None, pad_id: int = 0) -> None:
        self.engine = engine  # a deepshard.pipeline PipelineEngine: a core TrainingEngine, as the engine is
        self.microbatches = microbatches
        self.device = device
        # the schedule's stages were shaped by the first step: forward-only calls send the same shapes
        self.rows_per_forward = microbatches * micro_batch_size
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.prof = None
        self.dp_size = axis_size(mesh, "dp")
        self._counts = (0, 0)

    def _stack(self, parts: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        ids = torch.cat([p["input_ids"] for p in parts]).to(self.device)
        labels = torch.cat([p["labels"] for p in parts]).to(self.device)
        kwargs = {"doc_ids": torch.cat([p["doc_ids"] for p in parts]).to(self.device)} if "doc_ids" in parts[0] else {}
        return ids, labels, kwargs

    def forward_backward(self, batches: Iterator[dict]) -> torch.Tensor:
        """The schedule's forward and backward of the step's micro-batches; the step's loss on every rank."""
        parts = [next(batches) for _ in range(self.microbatches)]
        # every dp replica's batches are data.seq_len long here (no pad_to_multiple_of under pp): this
        # replica's count times dp is the step's, without a collective
        self._counts = tuple(self.dp_size * n for n in computed_positions(parts))
        ids, labels, kwargs = self._stack(parts)
        with self.prof.phase("forward"):  # forward and backward run inside the schedule
            return self.engine.forward_backward(ids, labels, **kwargs)

    def step_counts(self) -> tuple[int, int]:
        return self._counts

    def loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """This replica's summed token loss over ``rows_per_forward`` rows (forward only)."""
        ids, labels, kwargs = self._stack([batch])
        return self.engine.loss_sum(ids, labels, **kwargs)

    def next_token(self, ids: list[int], *, max_seq_len: int) -> int:
        """The greedy next token after ``ids``: the context (its last ``seq_len`` tokens) padded on the
        right to the training shape (causal attention: the padding changes nothing before it)."""
        context = ids[-min(max_seq_len, self.seq_len):]
        row = context + [self.pad_id] * (self.seq_len - len(context))
        batch = torch.tensor([row] * self.rows_per_forward, device=self.device)
        positions = torch.full((self.rows_per_forward,), len(context) - 1, device=self.device)
        token = self.engine.greedy_tokens(batch, positions)[:1]
        if dist.is_initialized():
            dist.broadcast(token, src=0)
        return int(token)
