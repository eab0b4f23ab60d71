"""The collectives of stages 1-2 in the form each backend runs fastest.

gloo's ``all_gather_single`` and ``reduce_scatter_single`` copy through staging buffers and ran about
3x slower than the same bytes moved by broadcasts or a pairwise send/recv (measured here, torch 2.13,
world 2, fp32): 17M elements all-gather 84 ms vs 26 ms by broadcasts, reduce-scatter 113 ms vs 35 ms
by a send/recv exchange (an all-reduce of the same 17M: 69 ms); 5M elements 18.5 vs 8.3 ms and 30.5
vs 10.4 ms.  Other backends (nccl) get the native collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Works", "all_gather_in_place", "exchange_with_peer", "pairwise_reduce_scatter"]


class Works:
    """Several collectives waited for as one."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


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
