"""Ulysses sequence parallelism (DeepSpeed's ``sequence_parallel_size``, ALST): the all-to-alls.

Each of the ``N`` ranks of the ``sp`` group holds ``seq / N`` consecutive tokens of every sequence.
Everything outside attention is per token, so it runs on the local slice unchanged.  Attention needs
whole sequences: before it, one all-to-all turns [batch, heads, seq/N, d] (sequence-sharded) into
[batch, heads/N, seq, d] (head-sharded: rank r holds heads ``r*heads/N ...`` for the whole
sequence), and after it the inverse all-to-all turns the output back.  Each is an autograd
function whose backward is the other all-to-all, so gradients flow to the tokens' own ranks.

Every tensor handed to a collective lives where its input lives: the compute device.

Inside a compiled block (``compile=true``, ``fullgraph``) dynamo cannot trace ``dist.all_to_all_single``
(an in-place op on a process group) nor the autograd functions around it: there the all-to-all is
torch's functional collective with its own autograd (``all_to_all_single_autograd``, whose backward
is the inverse all-to-all), and the reshapes around it are differentiated as ordinary ops.  Same
chunks, same order, so the compiled block computes what the eager one does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup

__all__ = ["expand_kv_heads", "gather_sequence", "heads_to_seq", "seq_to_heads", "shard_sequence"]


def _all_to_all(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i; chunk i of the result came from rank i."""
    x = x.contiguous()  # before empty_like, which would copy a permuted input's strides
    if torch.compiler.is_compiling():  # traced into the block's graph; differentiable by itself
        return funcol.all_to_all_single_autograd(x, None, None, group)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    b, h, s, d = x.shape
    # send head chunk j to rank j; receive this rank's head chunk of every rank's sequence slice
    parts = _all_to_all(x.reshape(b, n, h // n, s, d).transpose(0, 1), group)  # [n (seq slice), b, h/n, s, d]
    return parts.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = dist.get_world_size(group)
    b, h, s_all, d = x.shape
    s = s_all // n
    # send sequence slice j to rank j; receive every rank's head chunk of this rank's slice
    parts = _all_to_all(x.reshape(b, h, n, s, d).permute(2, 0, 1, 3, 4), group)  # [n (head chunk), b, h, s, d]
    return parts.transpose(0, 1).reshape(b, n * h, s, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[b, h, s/N, d] sequence-sharded -> [b, h/N, s, d] head-sharded (``h`` divisible by N)."""
    n = dist.get_world_size(group)
    assert x.shape[1] % n == 0, f"{x.shape[1]} heads over {n} sequence-parallel ranks"
    if torch.compiler.is_compiling():
        return _seq_to_heads(x, group)
    return _SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`: [b, h/N, s, d] -> [b, h, s/N, d]."""
    if torch.compiler.is_compiling():
        return _heads_to_seq(x, group)
    return _HeadsToSeq.apply(x, group)


def expand_kv_heads(k: torch.Tensor, v: torch.Tensor, *, num_q_heads: int, sp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query k, v [b, hkv, s, d] with ``hkv`` not divisible by ``sp``: repeat each kv head so the
    head chunks line up with the q heads' (chunk r of q heads uses chunk r of kv heads).  Repeating to
    ``sp`` heads serves when ``sp`` is a multiple of ``hkv``; else to one kv head per q head (plain MHA).
    The backward of the repeat sums the copies' gradients into their kv head."""
    hkv = k.shape[1]
    if hkv % sp == 0:
        return k, v
    rep = sp // hkv if sp % hkv == 0 else num_q_heads // hkv
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def shard_sequence(x: torch.Tensor, rank: int, size: int, dim: int = 1) -> torch.Tensor:
    """This rank's consecutive slice of ``dim`` (the sequence), of ``x.shape[dim] / size`` positions."""
    length = x.shape[dim]
    assert length % size == 0, f"sequence of {length} over {size} ranks"
    step = length // size
    return x.narrow(dim, rank * step, step)


def gather_sequence(x: torch.Tensor, group: ProcessGroup, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's slice (no gradient: for ``doc_ids`` and the like)."""
    n = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)
