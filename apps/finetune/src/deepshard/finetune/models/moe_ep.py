"""Expert parallelism (``parallel.ep``): each rank of an ep group holds ``num_experts / ep`` experts and
the tokens travel to them and back by all-to-all (torchtitan's token dispatch, written here).

A layer's forward, per rank: the (token, slot) pairs sorted by global expert (``models/moe.py``) are
already grouped by destination rank (rank r holds experts ``r*L .. r*L+L-1``); the per-expert counts
go first (one ``all_to_all_single`` of E integers), then the rows with uneven splits, all on the compute
device.  The rows a rank receives come ordered (source rank, local expert); a permutation puts them in
(local expert, source rank) order so the local experts run as one grouped GEMM, and its inverse puts
the outputs back before the return all-to-all.  Autograd runs the same exchanges reversed.

Gradients: a rank's expert gradient sums the tokens of every rank in its ep group, and ZeRO then
averages it over the ``edp`` ranks, where the step's loss factor assumes an average over all ``dp``
(``ep x edp``) ranks; the experts' weights therefore pass a ``1/ep`` gradient scale (identity in
forward), which makes every stage's expert gradient the single-process one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward sends the gradients the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],  # type: ignore[override]
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class ScaleGrad(torch.autograd.Function):
    """Identity in forward; the gradient times ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.scale, None


def dispatch_and_run(experts: nn.Module, x: torch.Tensor, counts: torch.Tensor,
                     group: dist.ProcessGroup) -> torch.Tensor:
    """``x`` [rows, H]: this rank's (token, slot) rows sorted by global expert, ``counts`` [E] rows per
    expert; the rows go to their experts' ranks, run there, and come back in ``x``'s order."""
    ep = group.size()
    local = counts.numel() // ep
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [source rank, local expert] counts, flat
    received = received.view(ep, local)
    send_splits = counts.view(ep, local).sum(1).tolist()  # the one host sync: the splits
    recv_splits = received.sum(1).tolist()
    rows = _AllToAll.apply(x, recv_splits, send_splits, group)
    segment = torch.repeat_interleave(torch.arange(ep * local, device=counts.device), received.reshape(-1))
    order = ((segment % local) * ep + segment // local).argsort(stable=True)  # -> (local expert, source)
    out = experts(rows[order], received.sum(0))
    return _AllToAll.apply(out[order.argsort()], send_splits, recv_splits, group)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Keep only this rank's experts in every sparse layer of ``model`` (real or meta weights) and route
    their tokens over ``ep_mesh``; returns the expert modules (ZeRO shards them over the dp ranks left
    after ep).  ValueError naming the keys unless ep divides the experts."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    layers = [m for m in model.modules() if hasattr(m, "ep_group")]  # models/moe.py's SparseMoe (no import: a cycle)
    experts = []
    for moe in layers:
        if moe.num_experts % ep:
            raise ValueError(f"parallel.ep={ep} does not divide model.num_experts={moe.num_experts}: each rank "
                             f"holds num_experts / ep experts; choose ep among its divisors")
        moe.experts.shard(rank, ep)
        moe.ep_group = ep_mesh.get_group()
        experts.append(moe.experts)
    return experts
