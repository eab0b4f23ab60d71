"""Stage 3: FSDP2 ``fully_shard`` per block and at the root; params, grads and state all Shard(0)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # FSDP2's hook types
from torch.distributed.tensor import DTensor, Shard

from deepshard.core.dtensor_utils import dtensor_replication, local_tensor, param_shard
from deepshard.core.zero.collectives import GlooAllGather, GlooReduceScatter
from deepshard.core.zero.stages import ZeroStage, held_grad_bytes, param_grads, trainable


@runtime_checkable
class ParamOffload(Protocol):
    """Stage 3's sharded params rest in host memory between uses (FSDP2's CPU offload policy on
    every unit), passed as ``offload_params``: :class:`CpuParamOffload` (``offload.params=cpu``), or
    offload's ``ParamSwap`` (``offload.params=nvme``), which hooks the units, keeps gradients out of
    ``.grad`` and answers for them."""

    def attach(self, model: nn.Module, blocks: list[nn.Module]) -> None: ...
    def local_grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]: ...
    def zero_grad(self) -> None: ...
    def param_bytes(self, params: list[nn.Parameter]) -> int: ...


class CpuParamOffload:
    """``offload.params=cpu``: FSDP2 keeps the shards in host memory and moves them per all-gather;
    gradients stay in ``.grad``.  Holds nothing, so one serves every pipeline stage."""

    def attach(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        pass

    def local_grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        return param_grads(params)

    def zero_grad(self) -> None:
        pass

    def param_bytes(self, params: list[nn.Parameter]) -> int:
        return sum(local_tensor(p.data).nbytes for p in params)


def apply_fsdp(
    model: nn.Module,
    blocks: Iterable[nn.Module],
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool | int,
    offload_params: ParamOffload | None = None,
    prefetch: int = 1,
    all_gather: AllGather | None = None,
    reduce_scatter: ReduceScatter | None = None,
) -> None:
    """Shard each block, then the root (embeddings, final norm, head), torchtitan's order.

    ``prefetch`` blocks ahead are all-gathered explicitly in forward and backward, so the next
    block's parameters arrive while this one computes.  On gloo, FSDP2 collects through the forms
    gloo runs fastest (``zero.collectives``); other backends keep FSDP2's own.  ``reshard_after_forward``
    an int is ZeRO++'s hpZ partition size (see the loop below).  ``all_gather`` /
    ``reduce_scatter`` replace those on any backend (ZeRO++'s quantized forms, ``zero.quantized``).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinning needs an accelerator: on a CPU-only host the params simply stay in (plain) host memory.
    offload: OffloadPolicy = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_params is not None
                              else OffloadPolicy())
    blocks = list(blocks)
    for i, block in enumerate(blocks):
        # The last block is the first backward needs: resharding it after forward would only gather it
        # again at once (torchtitan's default; FSDP2 keeps the root gathered for the same reason).
        last = i == len(blocks) - 1 and offload_params is None
        # an int N (hpZ): after forward each block keeps a secondary shard over groups of N consecutive ranks
        # (a node), so backward all-gathers it inside the node (FSDP2's post-forward mesh)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False if last else reshard_after_forward,
                    offload_policy=offload)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                offload_policy=offload)
    gloo = dist.get_backend(dp_mesh.get_group(dp_mesh.ndim - 1)) == "gloo"  # HSDP: the shard axis is the last
    for unit in [*blocks, model]:
        assert isinstance(unit, FSDPModule)
        if all_gather is not None or gloo:
            unit.set_custom_all_gather(all_gather or GlooAllGather())
        if reduce_scatter is not None or gloo:
            unit.set_custom_reduce_scatter(reduce_scatter or GlooReduceScatter())
    if prefetch > 0 and len(blocks) > 1:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch])
            block.set_modules_to_backward_prefetch(list(reversed(blocks[max(0, i - prefetch):i])))
    if offload_params is not None:
        offload_params.attach(model, blocks)


def shard_experts(experts: Iterable[nn.Module], mesh: DeviceMesh, *, param_dtype: torch.dtype,
                  reduce_dtype: torch.dtype) -> None:
    """Stage 3 of MoE experts under expert parallelism: each module of this rank's experts its own FSDP2
    unit over ``mesh`` (the dp ranks left after ep), gathered when it runs and resharded after (torchtitan's
    layout).  Call before :func:`apply_fsdp`, whose units then leave these params alone."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    gloo = dist.get_backend(mesh.get_group()) == "gloo"
    for module in experts:
        fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        if gloo:
            module.set_custom_all_gather(GlooAllGather())
            module.set_custom_reduce_scatter(GlooReduceScatter())


class FullyShardedStage(ZeroStage):
    """Stage 3: the sharded fp32 params *are* the master weights; FSDP2 reduce-scatters grads."""

    zero_stage = 3

    def __init__(self, model: nn.Module, *, param_offload: ParamOffload | None = None,
                 error_feedback: object | None = None) -> None:
        self.model = model
        self.names, self.params = trainable(model)
        self.param_offload = param_offload
        self.error_feedback = error_feedback  # LoCo's buffers (zero.loco: core.zero.loco.ErrorFeedback)

    def set_grad_sync(self, enabled: bool) -> None:
        # HSDP: the all-reduce across replicas only at the accumulation boundary (FSDP2 sums the
        # micro-steps' reduce-scatter outputs meanwhile); flat FSDP2 has none, so this changes nothing
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_all_reduce(enabled)

    def buffer_bytes(self) -> dict[str, int]:
        return {} if self.error_feedback is None else {"loco_error_feedback": self.error_feedback.nbytes()}

    def local_params(self) -> list[torch.Tensor]:
        return [param_shard(p) for p in self.params]

    def shard_group(self) -> dist.ProcessGroup | None:
        """FSDP2's Shard(0) mesh dim (HSDP: dp_shard; the replicas hold identical shards)."""
        for p in self.params:
            if isinstance(p, DTensor):
                for dim, placement in enumerate(p.placements):
                    if placement == Shard(0):
                        return p.device_mesh.get_group(dim)
        return None

    def local_grads(self) -> list[torch.Tensor]:
        if self.param_offload is not None:  # with NVMe the gradients went to a file: their norms stand in
            return self.param_offload.local_grads(self.params)
        return param_grads(self.params)

    def replication(self) -> list[int]:
        return [dtensor_replication(p) for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.param_offload is not None:
            self.param_offload.zero_grad()

    def grad_bytes(self) -> int:
        return held_grad_bytes(self.params)

    def param_bytes(self) -> int:
        if self.param_offload is not None:  # shards in memory right now (with NVMe: the rest are in a file)
            return self.param_offload.param_bytes(self.params)
        return sum(local_tensor(p.data).nbytes for p in self.params)
