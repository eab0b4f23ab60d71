"""ZeRO stages 0-2: params stay replicated; gradients and optimizer state follow the README's ZeRO table.

Every stage answers the same few questions for the optimizer glue (which local tensors to update,
with which local gradients, how many ranks hold identical copies of each) and never knows where
the optimizer state lives: that is the StateStore's business.  A stage is built from its parts,
passed in: a reducer (all-reduce or reduce-scatter of gradient buckets) and, for stages 1-2, a
gatherer (all-gather of the updated shards); ``apply_zero`` in ``deepshard.core.zero`` wires them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepshard.core.dtensor_utils import dtensor_replication, local_grad, local_tensor, storage_bytes
from deepshard.core.zero.gather import ShardGatherer
from deepshard.core.zero.handoff import GradHandoff
from deepshard.core.zero.layout import local_shard
from deepshard.core.zero.reducer import AllReduceReducer, FullGradScatterReducer, ReduceScatterReducer


class ZeroStage(ABC):
    """What the optimizer glue needs from a stage."""

    zero_stage: int
    params: list[nn.Parameter]
    names: list[str]
    expert_parallel: bool = False  # MoE experts split over an ep axis (zero.split)
    expert_layout: Any = None  # zero.split.ExpertLayout under ep: the experts' canonical checkpoint layout

    @abstractmethod
    def local_params(self) -> list[torch.Tensor]:
        """The tensors this rank updates (the StateStore writes into them)."""

    @abstractmethod
    def local_grads(self) -> list[torch.Tensor]:
        """This rank's averaged gradients aligned with :meth:`local_params` (zeros where none)."""

    @abstractmethod
    def replication(self) -> list[int]:
        """How many ranks of the dp group hold an identical copy of each local gradient."""

    def shard_group(self) -> dist.ProcessGroup | None:
        """The group over whose ranks :meth:`local_params` are Shard(0) row chunks (None: whole tensors)."""
        return None

    def grad_handoffs(self) -> list[tuple[GradHandoff, int]]:
        """(handoff, index offset) pairs of the parts that hand final gradients over during backward."""
        return []

    def handed_over(self) -> set[int]:
        """Indices whose final gradient already reached the store during backward (see GradHandoff)."""
        return {offset + i for handoff, offset in self.grad_handoffs() for i in handoff.indices}

    def set_grad_sync(self, enabled: bool) -> None:  # noqa: B027 - stages without no_sync ignore it
        """Whether this micro-step's backward reduces gradients (False: accumulate locally)."""

    def finish_backward(self) -> None:  # noqa: B027
        """Wait for the reductions launched during backward."""

    def after_step(self) -> None:  # noqa: B027
        """Make the updated shards visible where the model computes (all-gather for stages 1-2)."""

    def gather_params(self) -> None:  # noqa: B027
        """Finish an all-gather of updated params still running into the next forward (stages 1-2
        with ``zero.overlap_allgather``): after it every parameter holds its updated value."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def grad_bytes(self) -> int:
        """Bytes of gradients this rank holds right now."""

    def buffer_bytes(self) -> dict[str, int]:
        """Named communication buffers the stage keeps between steps (bucket pools, gather buffers)."""
        return {}

    def param_bytes(self) -> int:
        return storage_bytes(p.data for p in self.params)


def param_grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each param's local gradient, zeros where backward left none (stages whose grads live in ``.grad``)."""
    return [local_grad(p) if p.grad is not None else torch.zeros_like(local_tensor(p.data)) for p in params]


def held_grad_bytes(params: list[nn.Parameter]) -> int:
    return sum(local_tensor(p.grad).nbytes for p in params if p.grad is not None)


def trainable(model: nn.Module) -> tuple[list[str], list[nn.Parameter]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, _ in named], [p for _, p in named]


class _BucketedStage(ZeroStage):
    """Stages 0-2: replicated params whose gradients a bucketed reducer reduces during backward."""

    def __init__(self, names: list[str], params: list[nn.Parameter],
                 reducer: AllReduceReducer | ReduceScatterReducer) -> None:
        self.names, self.params, self.reducer = names, params, reducer
        self.world, self.rank = reducer.world, reducer.rank

    def finish_backward(self) -> None:
        self.reducer.finish()

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def grad_bytes(self) -> int:
        return self.reducer.grad_bytes()

    def _sharded_params(self) -> list[torch.Tensor]:
        return [local_shard(local_tensor(p.data), self.world, self.rank) for p in self.params]


class ReplicatedStage(_BucketedStage):
    """Stage 0 (DDP): replicated params, all-reduced grads, replicated optimizer state."""

    zero_stage = 0

    def __init__(self, names: list[str], params: list[nn.Parameter], *, reducer: AllReduceReducer) -> None:
        super().__init__(names, params, reducer)

    def set_grad_sync(self, enabled: bool) -> None:
        self.reducer.sync = enabled

    def local_params(self) -> list[torch.Tensor]:
        return [local_tensor(p.data) for p in self.params]

    def local_grads(self) -> list[torch.Tensor]:
        return [self.reducer.grad(i) for i in range(len(self.params))]

    def replication(self) -> list[int]:
        return [self.world * dtensor_replication(p) for p in self.params]


class _GatheringStage(_BucketedStage):
    """Stages 1-2: each rank updates only its Shard(0) chunk of every param; a gatherer all-gathers
    the updated chunks back into the replicated params, right after the step or, with
    ``gather_in_forward`` (``zero.overlap_allgather``), bucket by bucket inside the next forward."""

    def __init__(self, names: list[str], params: list[nn.Parameter], *,
                 reducer: AllReduceReducer | ReduceScatterReducer, gatherer: ShardGatherer,
                 gather_in_forward: bool = False) -> None:
        super().__init__(names, params, reducer)
        self.gatherer, self.gather_in_forward = gatherer, gather_in_forward

    def local_params(self) -> list[torch.Tensor]:
        return self._sharded_params()

    def shard_group(self) -> dist.ProcessGroup | None:
        return self.reducer.group

    def replication(self) -> list[int]:
        return [dtensor_replication(p) for p in self.params]

    def after_step(self) -> None:
        if self.gather_in_forward:  # bucket 0 now; the forward pre-hooks take it from there
            self.gatherer.start()
        else:
            self.gatherer.gather()

    def gather_params(self) -> None:
        self.gatherer.finish()

    def finish_backward(self) -> None:
        self.gatherer.finish()  # a forward that skipped some modules left buckets in flight
        self.reducer.finish()

    def buffer_bytes(self) -> dict[str, int]:
        return {"allgather": self.gatherer.buffer_bytes()}


class ShardedOptimizerStage(_GatheringStage):
    """Stage 1: full grads accumulate as in stage 0 and are reduce-scattered at the accumulation
    boundary; each rank updates only its Shard(0) chunk, the one it got averaged."""

    zero_stage = 1
    reducer: FullGradScatterReducer

    def set_grad_sync(self, enabled: bool) -> None:
        self.reducer.sync = enabled

    def local_grads(self) -> list[torch.Tensor]:
        return [local_shard(self.reducer.grad(i), self.world, self.rank) for i in range(len(self.params))]


class ShardedGradStage(_GatheringStage):
    """Stage 2: grads reduce-scattered into Shard(0) buckets as backward runs; full grads never kept."""

    zero_stage = 2
    reducer: ReduceScatterReducer

    def set_grad_sync(self, enabled: bool) -> None:
        """Stage 2 reduces every micro-step (holding unreduced full grads would defeat it); ``enabled``
        marks the accumulation boundary, where each reduced shard is final as soon as it lands."""
        self.reducer.final = enabled

    def grad_handoffs(self) -> list[tuple[GradHandoff, int]]:
        return [(self.reducer.handoff, 0)] if self.reducer.handoff is not None else []

    def local_grads(self) -> list[torch.Tensor]:
        return [self.reducer.shard_grad(i) for i in range(len(self.params))]

    def buffer_bytes(self) -> dict[str, int]:
        return {"reduce_scatter": self.reducer.pool_bytes(), **super().buffer_bytes()}
