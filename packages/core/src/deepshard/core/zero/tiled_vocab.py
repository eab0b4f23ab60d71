"""Memory-centric tiling of the vocabulary operators (ZeRO-Infinity's answer for large operators).

Under ZeRO-3 the embedding and the LM head are the largest units of a Llama (Llama-3: 2 x 128256 x
4096 parameters), and gathering either whole costs a full copy of it plus its gradient.  Here both
run on their data-parallel shard (a ``Shard(0)`` DTensor over the vocabulary rows, as FSDP2 lays it
out, or a plain tensor on one rank) in *tiles* of rows: a tile gathers ``tile_size`` rows of every
rank's shard (one ``all_gather_single``), is used, and is freed; the backward does the same and
reduce-scatters the tile's weight gradient straight into this rank's rows.  At most one tile of the
weight and one of its gradient are ever whole.

- :func:`tiled_linear_cross_entropy`: the head fused with the loss.  Forward keeps, per token, a
  running log-sum-exp and the target's logit over the tiles (token chunks inside a tile bound the
  ``[chunk, tile]`` logits); backward recomputes each tile's logits from the saved log-sum-exp.
- :func:`tiled_embedding`: each tile serves the ids that fall in it; backward scatters the output
  gradient into a tile-sized gradient and reduce-scatters it.

Gradients of the shard are reduced like FSDP2's: averaged over the shard's group (``grad_reduce``),
so a loss scaled for ZeRO's average gives the same step.  ``shard_io`` (optional, a :class:`ShardIO`)
stands for the shard's data where it is not in memory (ZeRO-Infinity with params on NVMe): each
tile reads only its rows of this rank's shard from it, and the tile's reduced gradient rows go to
it instead of the shard's ``.grad``, so the shard is never whole in memory, nor its gradient.

It lives in core, not in ``deepshard.kernels``: it runs collectives, and kernels is torch and Triton only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

__all__ = ["ShardIO", "ShardInfo", "tiled_embedding", "tiled_linear_cross_entropy"]

_REDUCTIONS = ("mean", "sum")


class ShardIO(Protocol):
    """This rank's shard of a tiled weight where it lives outside memory (a parameter swap)."""

    def rows(self, start: int, rows: int) -> contextlib.AbstractContextManager[torch.Tensor]:
        """Rows ``start ... start + rows`` of the local shard (fewer at its end), valid inside."""
        ...

    def add_grad(self, start: int, grad: torch.Tensor) -> None:
        """Add the fp32 gradient of rows ``start ... start + len(grad)`` of the local shard."""
        ...

    def grads_done(self) -> None:
        """A backward has given every tile's gradient."""
        ...


class ShardInfo:
    """Where this rank's rows sit in the global ``[vocab, hidden]`` weight (torch.chunk layout:
    rank ``r`` owns rows ``[r * rows_per_rank, ...)``, trailing ranks may own fewer or none)."""

    def __init__(self, vocab_size: int, world: int, rank: int, group: Any) -> None:
        self.vocab_size, self.world, self.rank, self.group = vocab_size, world, rank, group
        self.rows_per_rank = -(-vocab_size // world)
        self.local_rows = max(0, min(self.rows_per_rank, vocab_size - rank * self.rows_per_rank))

    @classmethod
    def of(cls, weight: Any) -> ShardInfo:
        """From a plain weight (one rank) or a ``Shard(0)`` DTensor on a 1-D mesh (or a flattened one)."""
        if not isinstance(weight, DTensor):
            return cls(weight.shape[0], 1, 0, None)
        placements = weight.placements
        if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
            raise ValueError(f"tiled vocabulary ops: the weight must be Shard(0) on a 1-D mesh, got {placements}")
        mesh = weight.device_mesh
        return cls(weight.shape[0], mesh.size(), mesh.get_local_rank(), mesh.get_group())

    def tiles(self, tile_size: int) -> Iterator[tuple[int, int]]:
        """(first local row, rows) of each tile; every rank walks the same tiles (collectives match)."""
        for start in range(0, self.rows_per_rank, tile_size):
            yield start, min(tile_size, self.rows_per_rank - start)

    def tile_rows(self, start: int, rows: int, device: torch.device) -> torch.Tensor:
        """Global vocabulary index of each row of a gathered tile (rank-major); >= vocab where padded."""
        ranks = torch.arange(self.world, device=device).unsqueeze(1) * self.rows_per_rank
        return (ranks + start + torch.arange(rows, device=device)).reshape(-1)

    def tile_columns(self, ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For global ``ids``: whether each falls in this tile, and its row in the gathered tile."""
        owner, row = ids // self.rows_per_rank, ids % self.rows_per_rank
        inside = (row >= start) & (row < start + rows) & (ids >= 0) & (ids < self.vocab_size)
        return inside, owner * rows + (row - start)


def _gather_tile(piece: torch.Tensor, info: ShardInfo, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """``rows`` rows of every rank's shard, rank-major, in ``dtype``, from this rank's ``piece`` of
    them (zeros where a rank owns fewer rows)."""
    local = piece
    if piece.shape[0] < rows or piece.dtype != dtype:
        padded = torch.zeros((rows, local.shape[1]), dtype=dtype, device=local.device)
        padded[:piece.shape[0]].copy_(piece)
        piece = padded
    if info.world == 1:
        return piece
    out = torch.empty((info.world * rows, local.shape[1]), dtype=dtype, device=local.device)
    dist.all_gather_single(out, piece.contiguous(), group=info.group)
    return out


def _scatter_tile_grad(grad_tile: torch.Tensor, grad_local: torch.Tensor | ShardIO, info: ShardInfo, start: int,
                       rows: int, op: str) -> None:
    """Reduce a gathered tile's fp32 gradient over the ranks and add this rank's rows into ``grad_local``
    (a tensor, or a :class:`ShardIO` that takes them)."""
    if info.world == 1:
        mine = grad_tile
    else:
        mine = torch.empty((rows, grad_tile.shape[1]), dtype=grad_tile.dtype, device=grad_tile.device)
        dist.reduce_scatter_single(mine, grad_tile, op=dist.ReduceOp.SUM, group=info.group)
        if op == "avg":
            mine.div_(info.world)
    have = max(0, min(rows, info.local_rows - start))
    if not have:
        return
    if isinstance(grad_local, torch.Tensor):
        grad_local[start:start + have].add_(mine[:have].to(grad_local.dtype))
    else:
        grad_local.add_grad(start, mine[:have])


@contextlib.contextmanager
def _tile(local: torch.Tensor, shard_io: ShardIO | None, start: int, rows: int) -> Iterator[torch.Tensor]:
    """This rank's rows of a tile: a slice of the shard, or read through ``shard_io``."""
    if shard_io is None:
        yield local[start:start + rows]
        return
    with shard_io.rows(start, max(0, min(rows, local.shape[0] - start))) as piece:
        yield piece.to(local.device)  # a swap file's rows land in host memory; the tile's all-gather runs here


class _TiledLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, local: torch.Tensor, targets: torch.Tensor, info: ShardInfo,
                opts: dict) -> torch.Tensor:
        n, device = hidden.shape[0], hidden.device
        valid = targets != opts["ignore_index"]
        safe = targets.masked_fill(~valid, 0)
        row_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=device)
        exp_sum = torch.zeros(n, dtype=torch.float32, device=device)
        target_logit = torch.zeros(n, dtype=torch.float32, device=device)
        for start, rows in info.tiles(opts["tile_size"]):
            with _tile(local, opts["shard_io"], start, rows) as piece:
                w = _gather_tile(piece, info, rows, hidden.dtype)
            pad = info.tile_rows(start, rows, device) >= info.vocab_size
            inside, col = info.tile_columns(safe, start, rows)
            for c0 in range(0, n, opts["chunk_size"]):
                c1 = min(c0 + opts["chunk_size"], n)
                logits = (hidden[c0:c1] @ w.t()).float().masked_fill_(pad, float("-inf"))
                m_new = torch.maximum(row_max[c0:c1], logits.amax(dim=1))
                exp_sum[c0:c1] = exp_sum[c0:c1] * torch.exp(row_max[c0:c1] - m_new) + torch.exp(
                    logits - m_new.unsqueeze(1)).sum(dim=1)
                row_max[c0:c1] = m_new
                here = inside[c0:c1]
                picked = logits.gather(1, col[c0:c1].clamp(0, logits.shape[1] - 1).unsqueeze(1)).squeeze(1)
                target_logit[c0:c1] += torch.where(here, picked, 0.0)
                del logits
            del w
        lse = row_max + exp_sum.log()
        loss_sum = ((lse - target_logit) * valid).sum()
        n_valid = valid.sum()
        ctx.info, ctx.opts, ctx.local = info, opts, local
        ctx.local_shape, ctx.local_dtype = local.shape, local.dtype
        ctx.save_for_backward(hidden, targets, lse, n_valid)
        return loss_sum / n_valid if opts["reduction"] == "mean" else loss_sum

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, targets, lse, n_valid = ctx.saved_tensors
        info, opts, local = ctx.info, ctx.opts, ctx.local
        n, device = hidden.shape[0], hidden.device
        valid = targets != opts["ignore_index"]
        safe = targets.masked_fill(~valid, 0)
        scale = grad_out.float() / n_valid.clamp(min=1).float() if opts["reduction"] == "mean" else grad_out.float()
        row_scale = (valid.float() * scale).unsqueeze(1)
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=device) if ctx.needs_input_grad[0] else None
        shard_io = opts["shard_io"]
        grad_w: Any = None
        if ctx.needs_input_grad[1]:
            grad_w = shard_io if shard_io is not None else torch.zeros(ctx.local_shape, dtype=torch.float32,
                                                                       device=device)
        for start, rows in info.tiles(opts["tile_size"]):
            with _tile(local, shard_io, start, rows) as piece:
                w = _gather_tile(piece, info, rows, hidden.dtype)
            pad = info.tile_rows(start, rows, device) >= info.vocab_size
            inside, col = info.tile_columns(safe, start, rows)
            grad_tile = torch.zeros(w.shape, dtype=torch.float32, device=device) if grad_w is not None else None
            for c0 in range(0, n, opts["chunk_size"]):
                c1 = min(c0 + opts["chunk_size"], n)
                h = hidden[c0:c1]
                p = (h @ w.t()).float().masked_fill_(pad, float("-inf"))
                p.sub_(lse[c0:c1].unsqueeze(1)).exp_()  # softmax over the whole vocabulary
                here = inside[c0:c1]
                rows_here = torch.nonzero(here).squeeze(1)
                p[rows_here, col[c0:c1][rows_here]] -= 1.0
                p.mul_(row_scale[c0:c1])
                if grad_h is not None:
                    grad_h[c0:c1].addmm_(p, w.float())
                if grad_tile is not None:
                    grad_tile.addmm_(p.t(), h.float())
                del p
            del w
            if grad_tile is not None:
                _scatter_tile_grad(grad_tile, grad_w, info, start, rows, opts["grad_reduce"])
        if shard_io is not None and grad_w is not None:
            shard_io.grads_done()
            grad_w = None  # the gradient went to the shard's owner, tile by tile
        return (None if grad_h is None else grad_h.to(hidden.dtype),
                None if grad_w is None else grad_w.to(ctx.local_dtype), None, None, None)


class _TiledEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, local: torch.Tensor, info: ShardInfo, opts: dict) -> torch.Tensor:
        flat = ids.reshape(-1)
        out = torch.zeros((flat.shape[0], local.shape[1]), dtype=opts["dtype"], device=local.device)
        for start, rows in info.tiles(opts["tile_size"]):
            with _tile(local, opts["shard_io"], start, rows) as piece:
                w = _gather_tile(piece, info, rows, opts["dtype"])
            inside, col = info.tile_columns(flat, start, rows)
            where = torch.nonzero(inside).squeeze(1)
            out[where] = w[col[where]]
            del w
        ctx.info, ctx.opts = info, opts
        ctx.local_shape, ctx.local_dtype, ctx.device = local.shape, local.dtype, local.device
        ctx.save_for_backward(flat)
        return out.reshape(*ids.shape, local.shape[1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if not ctx.needs_input_grad[1]:
            return None, None, None, None
        (flat,) = ctx.saved_tensors
        info, opts = ctx.info, ctx.opts
        g = grad_out.reshape(-1, grad_out.shape[-1]).float()
        shard_io = opts["shard_io"]
        grad_w: Any = shard_io if shard_io is not None else torch.zeros(ctx.local_shape, dtype=torch.float32,
                                                                        device=ctx.device)
        for start, rows in info.tiles(opts["tile_size"]):
            inside, col = info.tile_columns(flat, start, rows)
            where = torch.nonzero(inside).squeeze(1)
            grad_tile = torch.zeros((info.world * rows, g.shape[1]), dtype=torch.float32, device=ctx.device)
            grad_tile.index_add_(0, col[where], g[where])
            _scatter_tile_grad(grad_tile, grad_w, info, start, rows, opts["grad_reduce"])
        if shard_io is not None:
            shard_io.grads_done()
            return None, None, None, None
        return None, grad_w.to(ctx.local_dtype), None, None


def _local(weight: Any) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _check_common(name: str, tile_size: int, grad_reduce: str) -> None:
    if tile_size < 1:
        raise ValueError(f"{name}: tile_size={tile_size}; must be >= 1 (rows of each rank's shard per tile)")
    if grad_reduce not in ("avg", "sum"):
        raise ValueError(f"{name}: grad_reduce={grad_reduce!r}; valid: avg, sum")


def tiled_linear_cross_entropy(hidden: torch.Tensor, weight: Any, targets: torch.Tensor, *, ignore_index: int = -100,
                               reduction: str = "mean", tile_size: int = 4096, chunk_size: int = 1024,
                               grad_reduce: str = "avg", shard_io: ShardIO | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T`` (``hidden`` [N, H] this rank's tokens, ``weight`` [V, H]
    a ``Shard(0)`` DTensor or a plain tensor), the weight never gathered beyond ``tile_size`` rows
    per rank at a time; the logits never beyond ``[chunk_size, world * tile_size]``."""
    _check_common("tiled_linear_cross_entropy", tile_size, grad_reduce)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"tiled_linear_cross_entropy: reduction={reduction!r}; valid: mean, sum")
    if chunk_size < 1:
        raise ValueError(f"tiled_linear_cross_entropy: chunk_size={chunk_size}; must be >= 1")
    if hidden.dim() != 2 or targets.dim() != 1 or hidden.shape[0] != targets.shape[0] \
            or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"tiled_linear_cross_entropy: hidden {tuple(hidden.shape)}, weight "
                         f"{tuple(weight.shape)}, targets {tuple(targets.shape)} do not match ([N, H], [V, H], [N])")
    info = ShardInfo.of(weight)
    opts = dict(ignore_index=ignore_index, reduction=reduction, tile_size=tile_size, chunk_size=chunk_size,
                grad_reduce=grad_reduce, shard_io=shard_io)
    return _TiledLinearCE.apply(hidden, _local(weight), targets, info, opts)


def tiled_embedding(ids: torch.Tensor, weight: Any, *, tile_size: int = 4096, dtype: torch.dtype | None = None,
                    grad_reduce: str = "avg", shard_io: ShardIO | None = None) -> torch.Tensor:
    """``weight[ids]`` (``weight`` [V, H], a ``Shard(0)`` DTensor or a plain tensor) through tiles of
    ``tile_size`` rows per rank; the output in ``dtype`` (the compute dtype; default the weight's)."""
    _check_common("tiled_embedding", tile_size, grad_reduce)
    info = ShardInfo.of(weight)
    local = _local(weight)
    opts = dict(tile_size=tile_size, dtype=dtype or local.dtype, grad_reduce=grad_reduce, shard_io=shard_io)
    return _TiledEmbedding.apply(ids, local, info, opts)
