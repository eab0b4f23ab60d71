"""Bucket packing as the gloo collectives of stages 1-2 use it: one rank's segment packed alone
(the stage-2 send/recv exchange), padding zeroed however dirty the reused buffer, and this rank's own
chunks left alone on unpack (the params' own slices are already current)."""

from __future__ import annotations

import pytest
import torch

from deepshard.core.zero.layout import BucketLayout


def _tensors(rows: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return [torch.randn(rows, 3, generator=g), torch.randn(rows + 1, generator=g), torch.randn(2, 2, generator=g)]


def _rows(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """``rank``'s Shard(0) rows by torch.chunk (DTensor's rule; trailing ranks may get none)."""
    chunks = t.chunk(world)
    return chunks[rank] if rank < len(chunks) else t[:0]


def _expected_segment(tensors: list[torch.Tensor], layout: BucketLayout, world: int, rank: int) -> torch.Tensor:
    """Written from the layout's definition: each tensor's Shard(0) rows of ``rank``, zero-padded."""
    parts = []
    for slot, t in zip(layout.slots, tensors):
        chunk = _rows(t, world, rank).reshape(-1)
        parts += [chunk, torch.zeros(slot.padded - chunk.numel())]
    return torch.cat(parts)


@pytest.mark.parametrize("rows,world", [(7, 2), (5, 4), (1, 4), (12, 3)])
def test_packed_segments_are_shard_chunks_with_zero_padding_in_a_dirty_buffer(rows, world):
    tensors = _tensors(rows)
    layout = BucketLayout([0, 1, 2], [t.shape for t in tensors], world)
    full = torch.full((world * layout.segment,), float("nan"))  # a reused buffer holds anything
    layout.pack_full(tensors, full)
    for r in range(world):
        want = _expected_segment(tensors, layout, world, r)
        assert torch.equal(full.view(world, layout.segment)[r], want)
        one = torch.full((layout.segment,), float("nan"))
        layout.pack_rank(tensors, one, r)
        assert torch.equal(one, want)
        local = torch.full((layout.segment,), float("nan"))
        layout.pack_local([_rows(t, world, r) for t in tensors], local)
        assert torch.equal(local, want)


@pytest.mark.parametrize("rows,world", [(7, 2), (12, 3)])
def test_unpack_leaves_the_skipped_ranks_chunks_untouched(rows, world):
    tensors = _tensors(rows)
    layout = BucketLayout([0, 1, 2], [t.shape for t in tensors], world)
    buf = torch.empty(world * layout.segment)
    layout.pack_full(tensors, buf)
    out = [torch.full_like(t, -7.0) for t in tensors]
    layout.unpack_full(buf, out, skip_rank=1)
    for t, o in zip(tensors, out):
        mine = torch.zeros(t.shape[0], dtype=torch.bool)
        mine[torch.arange(t.shape[0]).chunk(world)[1]] = True
        assert torch.all(o[mine] == -7.0)
        assert torch.equal(o[~mine], t[~mine])
