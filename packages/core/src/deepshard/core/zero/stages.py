"""ZeRO stages 0-2: params stay replicated; gradients and optimizer state follow design.md's table.

Every stage answers the same few questions for the optimizer glue (which local tensors to update,
with which local gradients, how many ranks hold identical copies of each) and never knows where
the optimizer state lives: that is the StateStore's business.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from deepshard.core.dtensor_utils import dtensor_replication, local_tensor
from deepshard.core.zero.layout import BucketLayout, group_into_buckets, local_shard
from deepshard.core.zero.reducer import AllReduceReducer, ReduceScatterReducer


class ZeroStage(ABC):
    """What the optimizer glue needs from a stage."""

    stage: int
    params: list[nn.Parameter]
    names: list[str]
    # set by the optimizer to the store's grad_ready: a stage that knows a gradient shard is final
    # while backward still runs calls it then (offload starts the device->host copy early) and
    # records the index in ``reported``; the optimizer reports the rest at step time
    on_grad_ready: Callable[[int, torch.Tensor], None] | None = None
    reported: set[int] = frozenset()  # type: ignore[assignment]

    @abstractmethod
    def local_params(self) -> list[torch.Tensor]:
        """The tensors this rank updates (the StateStore writes into them)."""

    @abstractmethod
    def local_grads(self) -> list[torch.Tensor]:
        """This rank's averaged gradients aligned with :meth:`local_params` (zeros where none)."""

    @abstractmethod
    def replication(self) -> list[int]:
        """How many ranks of the dp group hold an identical copy of each local gradient."""

    def set_grad_sync(self, enabled: bool) -> None:  # noqa: B027 - stages without no_sync ignore it
        """Whether this micro-step's backward reduces gradients (False: accumulate locally)."""

    def finish_backward(self) -> None:  # noqa: B027
        """Wait for the reductions launched during backward."""

    def after_step(self) -> None:  # noqa: B027
        """Make the updated shards visible where the model computes (all-gather for stages 1-2)."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def grad_bytes(self) -> int:
        """Bytes of gradients this rank holds right now."""

    def param_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for p in self.params:
            t = local_tensor(p.data)
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total


def param_grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each param's local gradient, zeros where backward left none (stages whose grads live in ``.grad``)."""
    return [local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p.data)) for p in params]


def held_grad_bytes(params: list[nn.Parameter]) -> int:
    return sum(local_tensor(p.grad).nbytes for p in params if p.grad is not None)


def trainable(model: nn.Module) -> tuple[list[str], list[nn.Parameter]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [n for n, _ in named], [p for _, p in named]


class ReplicatedStage(ZeroStage):
    """Stage 0 (DDP): replicated params, all-reduced grads, replicated optimizer state."""

    stage = 0

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, *, reduce_bucket_numel: int,
                 overlap_comm: bool, reduce_dtype: torch.dtype = torch.float32) -> None:
        self.names, self.params = trainable(model)
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.reducer = AllReduceReducer(self.params, group, bucket_numel=reduce_bucket_numel,
                                        overlap=overlap_comm, reduce_dtype=reduce_dtype)

    def set_grad_sync(self, enabled: bool) -> None:
        self.reducer.sync = enabled

    def finish_backward(self) -> None:
        self.reducer.finish()

    def local_params(self) -> list[torch.Tensor]:
        return [local_tensor(p.data) for p in self.params]

    def local_grads(self) -> list[torch.Tensor]:
        return [self.reducer.grad(i) for i in range(len(self.params))]

    def replication(self) -> list[int]:
        return [self.world * dtensor_replication(p) for p in self.params]

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def grad_bytes(self) -> int:
        return self.reducer.grad_bytes()


class _GatherAfterStep:
    """All-gather each rank's updated Shard(0) chunks back into the replicated params, in buckets."""

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup, bucket_numel: int) -> None:
        self.params = params
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        groups = group_into_buckets([p.numel() for p in params], [p.dtype for p in params], bucket_numel)
        self.buckets = [(idx, BucketLayout(idx, [params[i].shape for i in idx], self.world)) for idx in groups]

        self._buffers: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _pair(self, k: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two reusable (send, recv) pairs, alternating: bucket k+1 gathers while k unpacks."""
        if dtype not in self._buffers:
            seg = max(layout.segment for _, layout in self.buckets)
            self._buffers[dtype] = [(torch.empty(seg, dtype=dtype, device=device),
                                     torch.empty(self.world * seg, dtype=dtype, device=device)) for _ in range(2)]
        return self._buffers[dtype][k % 2]

    def gather(self) -> None:
        pending = None
        for k, (idx, layout) in enumerate(self.buckets):
            full = [self.params[i] for i in idx]
            send, recv = self._pair(k, full[0].dtype, full[0].device)
            send, recv = send[:layout.segment], recv[:self.world * layout.segment]
            layout.pack_local([local_shard(t, self.world, self.rank) for t in full], send)
            work = dist.all_gather_single(recv, send, group=self.group, async_op=True)
            if pending is not None:
                self._unpack(*pending)
            pending = (work, layout, recv, full)
        if pending is not None:
            self._unpack(*pending)

    @staticmethod
    def _unpack(work: dist.Work, layout: BucketLayout, recv: torch.Tensor, full: list[torch.Tensor]) -> None:
        work.wait()
        layout.unpack_full(recv, full)


class ShardedOptimizerStage(ReplicatedStage):
    """Stage 1: grads all-reduced as in stage 0; each rank updates only its Shard(0) chunk."""

    stage = 1

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, *, reduce_bucket_numel: int,
                 allgather_bucket_numel: int, overlap_comm: bool, reduce_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(model, group, reduce_bucket_numel=reduce_bucket_numel, overlap_comm=overlap_comm,
                         reduce_dtype=reduce_dtype)
        self.gatherer = _GatherAfterStep([local_tensor(p.data) for p in self.params], group,
                                         allgather_bucket_numel)

    def local_params(self) -> list[torch.Tensor]:
        return [local_shard(local_tensor(p.data), self.world, self.rank) for p in self.params]

    def local_grads(self) -> list[torch.Tensor]:
        return [local_shard(g, self.world, self.rank) for g in super().local_grads()]

    def replication(self) -> list[int]:
        return [dtensor_replication(p) for p in self.params]

    def after_step(self) -> None:
        self.gatherer.gather()


class ShardedGradStage(ShardedOptimizerStage):
    """Stage 2: grads reduce-scattered into Shard(0) buckets as backward runs; full grads never kept."""

    stage = 2

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, *, reduce_bucket_numel: int,
                 allgather_bucket_numel: int, overlap_comm: bool, reduce_dtype: torch.dtype = torch.float32) -> None:
        self.names, self.params = trainable(model)
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.reducer = ReduceScatterReducer(self.params, group, bucket_numel=reduce_bucket_numel,
                                            overlap=overlap_comm, reduce_dtype=reduce_dtype,
                                            on_shard=self._shard_final)
        self.gatherer = _GatherAfterStep([local_tensor(p.data) for p in self.params], group,
                                         allgather_bucket_numel)
        self.reported = set()

    def set_grad_sync(self, enabled: bool) -> None:
        """Stage 2 reduces every micro-step (holding unreduced full grads would defeat it); ``enabled``
        marks the accumulation boundary, where each reduced shard is final as soon as it lands."""
        self.boundary = enabled

    def _shard_final(self, index: int, grad: torch.Tensor) -> None:
        if getattr(self, "boundary", True) and self.on_grad_ready is not None:
            self.on_grad_ready(index, grad)
            self.reported.add(index)

    def local_grads(self) -> list[torch.Tensor]:
        out = []
        for p, g in zip(self.params, self.reducer.shard_grads):
            out.append(g if g is not None else torch.zeros_like(local_shard(local_tensor(p.data), self.world,
                                                                            self.rank)))
        return out

    def zero_grad(self) -> None:
        self.reducer.zero_grad()
        self.reported = set()
        for p in self.params:
            p.grad = None

    def grad_bytes(self) -> int:
        shards = sum(g.nbytes for g in self.reducer.shard_grads if g is not None)
        return shards + sum(local_tensor(p.grad).nbytes for p in self.params if p.grad is not None)
