"""qgZ on every unit, and under HSDP also across the replicas: the all-reduce FSDP2 runs over
``dp_replicate`` after each unit's reduce-scatter becomes a quantized one.

FSDP2 (torch 2.13) has no custom all-reduce hook, only ``set_all_reduce_hook``, which runs on the
reduce-scatter output *after* FSDP2's own all-reduce (``foreach_reduce``: reduce-scatter, add the
micro-steps' partial sums, all-reduce over the replicate group, the hook, the post-divide, the views
into ``.grad``).  ``set_requires_all_reduce(False)`` cannot replace it: that path returns before the
hook and before any gradient is written, keeping only the partial sum.  So each unit's replicate group
is swapped for a group of this rank alone (FSDP2's all-reduce becomes a no-op that sends nothing) and
the hook does the real, quantized all-reduce; everything else stays FSDP2's, gradient accumulation
included: with ``set_requires_all_reduce(False)`` between boundaries (the stage's ``set_grad_sync``)
FSDP2 sums the micro-steps' reduce-scatter outputs and the hook runs once, at the last micro-step.

Divide factors: with ``set_force_sum_reduction_for_comms`` the reduce-scatter sums (no AVG on a
one-rank group, which NCCL may get wrong), the hook averages over the replicas and FSDP2's
post-divide then divides by ``dp_shard`` (its data-parallel size is ``dp_shard x 1`` now): the
gradient is the mean over all ``dp_shard x dp_replicate`` ranks, as FSDP2's own HSDP gives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

from deepshard.core.zero.collectives import all_gather_in_place
from deepshard.core.zero.loco import ErrorFeedback
from deepshard.core.zero.quantized import (
    QuantizedReduceScatter,
    node_mesh,
    pack_rows,
    trim_codes,
    unpack_rows,
    untrim_codes,
)
from deepshard.kernels.quantize import (
    DEFAULT_BLOCK,
    code_bytes,
    dequantize_blockwise,
    num_blocks,
    quantize_blockwise,
)

__all__ = ["QuantizedReplicaAllReduce", "attach_qgz"]


class QuantizedReplicaAllReduce:
    """The mean over ``group`` (HSDP's replicas) of a flat tensor, in place, as int blocks: each rank's
    chunk ``j`` goes to replica ``j`` by all-to-all and is summed there in fp32 (a reduce-scatter), the
    averaged chunk is re-quantized and all-gathered, and every rank dequantizes every chunk, its own
    included, so all replicas hold the same gradient.

    ``bits`` (8 or 4) for the reduction, as qgZ's hops; the gather of the finished mean always in int8:
    DeepSpeed's qgZ is a reduce-scatter and never rounds its result again, and a third int4 rounding of
    every gradient cost the 100-step test run 8% of its final loss (int8 there: within 0.1%)."""

    def __init__(self, group: dist.ProcessGroup, *, bits: int = 8, block_size: int = DEFAULT_BLOCK,
                 feedback: ErrorFeedback | None = None, key: object = 0) -> None:
        self.group, self.bits, self.block_size = group, bits, block_size
        self.feedback, self.key = feedback, key

    def _quantize(self, x: torch.Tensor, site: str, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.feedback is None:
            return quantize_blockwise(x, block_size=self.block_size, bits=bits)
        return self.feedback.quantize((self.key, site), x, block_size=self.block_size, bits=bits)

    @torch.no_grad()
    def __call__(self, tensor: torch.Tensor) -> None:
        r, rank, n = self.group.size(), self.group.rank(), tensor.numel()
        seg = -(-n // r)
        nb = num_blocks(seg, self.block_size)
        seg_p = nb * self.block_size  # whole blocks per chunk: no block (or int4 byte) straddles two replicas
        flat = torch.zeros(r * seg, dtype=torch.float32, device=tensor.device)
        flat[:n] = tensor.reshape(-1)
        chunks = torch.zeros(r, seg_p, dtype=torch.float32, device=tensor.device)
        chunks[:, :seg] = flat.view(r, seg)
        codes, scales = self._quantize(chunks, "replica_scatter", self.bits)
        sent = pack_rows(trim_codes(codes, r, seg, seg_p, self.bits), scales, r)  # the padding stays home
        recv = torch.empty_like(sent)
        dist.all_to_all_single(recv, sent, group=self.group)  # scales and codes in one message per peer
        got, recv_scales = unpack_rows(recv, nb, codes.dtype)
        mine = dequantize_blockwise(untrim_codes(got, r, seg, seg_p, self.bits), recv_scales, r * seg_p,
                                    block_size=self.block_size, bits=self.bits).view(r, seg_p).sum(dim=0) / r
        my_codes, my_scales = self._quantize(mine, "replica_gather", 8)  # the fp32 mean of this chunk
        packed = torch.empty(r, 4 * nb + code_bytes(seg, 8), dtype=torch.uint8, device=tensor.device)
        packed[rank].copy_(pack_rows(trim_codes(my_codes, 1, seg, seg_p, 8), my_scales, 1).view(-1))
        all_gather_in_place(packed.view(-1), rank, r, self.group).wait()  # one broadcast per replica
        all_codes, all_scales = unpack_rows(packed, nb, my_codes.dtype)
        out = dequantize_blockwise(untrim_codes(all_codes, r, seg, seg_p, 8), all_scales, r * seg_p,
                                   block_size=self.block_size, bits=8)
        tensor.view(-1).copy_(out.view(r, seg_p)[:, :seg].reshape(-1)[:n])


def _alone() -> dist.ProcessGroup:
    """A process group of this rank alone (FSDP2's all-reduce over it moves nothing)."""
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


def attach_qgz(units: Sequence[FSDPModule], shard_mesh: DeviceMesh, *, bits: int, node_size: int = 0,
               feedback: ErrorFeedback | None = None) -> None:
    """Hand each FSDP2 unit its quantized reduce-scatter (one per unit: LoCo's buffers are per unit)
    and, under HSDP (a 2-D ``(dp_replicate, dp_shard)`` ``shard_mesh``), the quantized all-reduce
    across the replicas in place of FSDP2's (see the module docstring).  Collective."""
    hsdp = shard_mesh.ndim > 1
    nodes = None if hsdp else node_mesh(shard_mesh, node_size)  # HSDP: the shard group is one node
    alone = _alone() if hsdp else None
    for i, unit in enumerate(units):
        unit.set_custom_reduce_scatter(QuantizedReduceScatter(bits=bits, nodes=nodes, feedback=feedback, key=i))
        if not hsdp:
            continue
        for group in unit._get_fsdp_state()._fsdp_param_groups:  # FSDP2 internals (torch 2.13), see above
            assert isinstance(group.mesh_info, HSDPMeshInfo), type(group.mesh_info)
            group.mesh_info.replicate_process_group = alone
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_all_reduce_hook(QuantizedReplicaAllReduce(shard_mesh.get_group(0), bits=bits, feedback=feedback,
                                                           key=i))
