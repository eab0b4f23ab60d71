"""The collectives of stages 1-2 in the form each backend runs fastest.

gloo's ``all_gather_single`` and ``reduce_scatter_single`` copy through staging buffers and ran about
3x slower than the same bytes moved by broadcasts or a pairwise send/recv (measured here, torch 2.13,
world 2, fp32): 17M elements all-gather 84 ms vs 26 ms by broadcasts, reduce-scatter 113 ms vs 35 ms
by a send/recv exchange (an all-reduce of the same 17M: 69 ms); 5M elements 18.5 vs 8.3 ms and 30.5
vs 10.4 ms.  Other backends (nccl) get the native collectives.  Stage 3 hands the same two to FSDP2
through its custom-collective hooks (``GlooAllGather``, ``GlooReduceScatter``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # FSDP2's hook types

__all__ = ["GlooAllGather", "GlooReduceScatter", "Works", "all_gather_in_place", "exchange_with_peer",
           "pairwise_reduce_scatter"]


class Works(dist.Work):
    """Several collectives waited for as one (a ``Work``: FSDP2 waits only on those)."""

    def __init__(self, works: list[dist.Work]) -> None:
        super().__init__()
        self.works = works

    def wait(self, timeout: object = None) -> bool:
        for work in self.works:
            work.wait()
        return True


def all_gather_in_place(buf: torch.Tensor, rank: int, world: int, group: dist.ProcessGroup) -> Works:
    """Every rank's segment of ``buf`` (``world`` equal segments, this rank's filled) onto every rank,
    asynchronously; on gloo as one broadcast per segment from its owner."""
    seg = buf.numel() // world
    if dist.get_backend(group) != "gloo":
        return Works([dist.all_gather_single(buf, buf[rank * seg:(rank + 1) * seg], group=group, async_op=True)])
    return Works([dist.broadcast(buf[r * seg:(r + 1) * seg], src=dist.get_global_rank(group, r), group=group,
                                 async_op=True) for r in range(world)])


def pairwise_reduce_scatter(group: dist.ProcessGroup) -> bool:
    """Whether a reduce-scatter over ``group`` runs as one send/recv exchange (gloo at world 2)."""
    return dist.get_backend(group) == "gloo" and dist.get_world_size(group) == 2


def exchange_with_peer(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup) -> Works:
    """World 2: ``send`` to the other rank while its ``send`` lands in ``recv``, asynchronously."""
    peer = dist.get_global_rank(group, 1 - dist.get_rank(group))
    return Works(dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer, group),
                                         dist.P2POp(dist.irecv, recv, peer, group)]))


class _PlainAlloc:
    """FSDP2's default allocation: a fresh tensor per collective (the caching allocator reuses it)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class GlooAllGather(_PlainAlloc, AllGather):
    """FSDP2's parameter all-gather as one broadcast per rank's segment (its input is already in place:
    FSDP2 copies it into this rank's segment of the output)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        seg = output_tensor.numel() // group.size()
        mine = output_tensor[group.rank() * seg:(group.rank() + 1) * seg]
        if mine.data_ptr() != input_tensor.data_ptr():
            mine.copy_(input_tensor)
        work = all_gather_in_place(output_tensor, group.rank(), group.size(), group)
        if async_op:
            return work
        work.wait()
        return None


class GlooReduceScatter(_PlainAlloc, ReduceScatter):
    """FSDP2's gradient reduce-scatter at world 2 as one send/recv exchange of host tensors; SUM and AVG
    (what FSDP2 asks for in fp32 and bf16), any other op or device by the native call."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object, async_op: bool = False) -> dist.Work | None:
        if group.size() != 2 or op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or input_tensor.device.type != "cpu":
            return dist.reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        rank, seg = group.rank(), output_tensor.numel()
        exchange_with_peer(input_tensor[(1 - rank) * seg:(2 - rank) * seg], output_tensor, group).wait()
        output_tensor.add_(input_tensor[rank * seg:(rank + 1) * seg])  # a + b == b + a: both ranks agree
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(2)
        return None
