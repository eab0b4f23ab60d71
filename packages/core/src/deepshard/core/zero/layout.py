"""Shard(0) arithmetic and rank-major buckets: one collective serves many parameters.

A bucket holds, for each rank in turn, that rank's Shard(0) chunk of every parameter in the
bucket, each padded to the same ``ceil(rows / N)`` rows.  So ``reduce_scatter_single`` leaves
each rank exactly its own chunks, and ``all_gather_single`` returns everyone's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def shard_rows(num_rows: int, world: int, rank: int) -> tuple[int, int]:
    """Row range ``[start, end)`` of ``rank``'s Shard(0) chunk (torch.chunk / DTensor semantics)."""
    per = -(-num_rows // world)
    start = min(rank * per, num_rows)
    return start, min(start + per, num_rows)


def local_shard(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """``rank``'s Shard(0) chunk of ``t`` as a view (0-d tensors are not sharded)."""
    if t.dim() == 0:
        return t
    start, end = shard_rows(t.shape[0], world, rank)
    return t[start:end]


@dataclass
class Slot:
    """Where one parameter's padded chunk sits inside each rank's segment of a bucket."""

    index: int  # position in the caller's parameter list
    offset: int  # element offset inside a rank segment
    padded: int  # elements of the padded chunk (ceil(rows/N) * row size)


class BucketLayout:
    """Rank-major packing of several same-dtype tensors' Shard(0) chunks."""

    def __init__(self, indices: list[int], shapes: list[torch.Size], world: int) -> None:
        self.world = world
        self.slots: list[Slot] = []
        offset = 0
        for i, shape in zip(indices, shapes):
            rows = shape[0] if len(shape) else 1
            row = 1
            for s in shape[1:]:
                row *= s
            padded = -(-rows // world) * row
            self.slots.append(Slot(i, offset, padded))
            offset += padded
        self.segment = offset  # elements per rank

    def _chunk(self, t: torch.Tensor, rank: int) -> tuple[int, int]:
        """``(element offset in flat t, element count)`` of ``rank``'s Shard(0) chunk of ``t``."""
        rows = t.shape[0] if t.dim() else 1
        row = t.numel() // max(rows, 1)
        start, end = shard_rows(rows, self.world, rank)
        return start * row, (end - start) * row

    def _chunks(self, t: torch.Tensor):
        """``(rank, element offset in flat t, element count)`` of every rank's Shard(0) chunk of ``t``."""
        for r in range(self.world):
            yield r, *self._chunk(t, r)

    @staticmethod
    def _place(out: torch.Tensor, slot: Slot, chunk: torch.Tensor) -> None:
        """``chunk`` (flat) into its slot of a rank segment ``out``; only the slot's padding is zeroed
        (a whole-buffer zero_() cost a full pass)."""
        n = chunk.numel()
        out[slot.offset:slot.offset + n].copy_(chunk)
        if n < slot.padded:
            out[slot.offset + n:slot.offset + slot.padded].zero_()

    def pack_full(self, tensors: list[torch.Tensor], out: torch.Tensor) -> None:
        """Fill ``out`` (``world * segment`` elements) with every rank's chunk of each full tensor."""
        seg = out.view(self.world, self.segment)
        for r in range(self.world):
            self.pack_rank(tensors, seg[r], r)

    def pack_rank(self, tensors: list[torch.Tensor], out: torch.Tensor, rank: int) -> None:
        """Fill ``out`` (``segment`` elements) with ``rank``'s chunk of each full tensor."""
        for slot, t in zip(self.slots, tensors):
            lo, n = self._chunk(t, rank)
            self._place(out, slot, t.reshape(-1)[lo:lo + n])

    def pack_local(self, chunks: list[torch.Tensor], out: torch.Tensor) -> None:
        """Fill ``out`` (``segment`` elements) with this rank's chunks."""
        for slot, c in zip(self.slots, chunks):
            self._place(out, slot, c.reshape(-1))

    def local_views(self, buf: torch.Tensor, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Views into a ``segment``-sized buffer shaped like this rank's chunks."""
        return [buf[s.offset:s.offset + c.numel()].view(c.shape) for s, c in zip(self.slots, chunks)]

    def unpack_full(self, buf: torch.Tensor, tensors: list[torch.Tensor], *, skip_rank: int | None = None) -> None:
        """Inverse of :meth:`pack_full`: write every rank's chunk (but ``skip_rank``'s) back into the full tensors."""
        seg = buf.view(self.world, self.segment)
        for slot, t in zip(self.slots, tensors):
            flat = t.view(-1)
            for r, lo, n in self._chunks(t):
                if r != skip_rank:
                    flat[lo:lo + n].copy_(seg[r, slot.offset:slot.offset + n])


def group_into_buckets(numels: list[int], dtypes: list[torch.dtype], bucket_size: int) -> list[list[int]]:
    """Consecutive indices grouped into buckets of at most ``bucket_size`` elements (one larger
    tensor makes a bucket of its own) and one dtype: ``zero.reduce_bucket_size`` or
    ``zero.allgather_bucket_size``, the config's names."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (n, dt) in enumerate(zip(numels, dtypes)):
        if current and (size + n > bucket_size or dtypes[current[0]] != dt):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets
