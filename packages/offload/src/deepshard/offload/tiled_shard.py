"""A vocabulary-tiled unit's shard on NVMe, read and written in rows (ZeRO-Infinity + tiling).

The tiled embedding and head (``deepshard.core.zero.tiled_vocab``) are FSDP2 units that are never
all-gathered: their ops gather tiles of rows.  With ``offload.params=nvme`` their shard stays in
the param file: each tile reads only its rows of it (a rank's rows of a ``Shard(0)`` weight are
contiguous; O_DIRECT needs 4096-aligned offsets and lengths, so an aligned superset of them is read
into an aligned tile buffer), after the unit's owed optimizer update has been applied (piece by
piece, :mod:`.deferred_step`).  The tile's reduced gradient rows are added into the grad file's
rows (a read-modify-write of the same superset: accumulated across micro-steps), and the norm of
the accumulated gradient is kept per param as :class:`~.grad_norms.GradNorms` keeps them.  Neither
the shard nor its gradient is ever whole in memory: one tile's rows of each, at most.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from .aio import align_up, aligned_empty
from .config import ALIGN
from .fsdp_hooks import shard_width
from .grad_norms import GradNorms
from .unit_swap import UnitSwap
from .units import Slot, Unit


class TiledShard:
    """``deepshard.core.zero.tiled_vocab.ShardIO`` for one tiled unit (one weight) of a param swap."""

    def __init__(self, *, swap: UnitSwap, unit: Unit, norms: GradNorms) -> None:
        self.swap = swap
        self.unit = unit
        self.norms = norms
        self._bufs: dict[str, torch.Tensor] = {}  # "param" / "grad": one aligned tile buffer each
        self._sumsq = 0.0  # of the accumulated gradient, over this backward's tiles so far
        self._in_backward = False

    @property
    def slot(self) -> Slot:
        assert len(self.unit.slots) == 1, f"{self.unit.name}: a tiled unit holds one weight"
        return self.unit.slots[0]

    def tile_bytes(self) -> int:
        """Bytes of the tile buffers allocated now (one tile's rows each, plus alignment)."""
        return sum(b.numel() for b in self._bufs.values())

    def _span(self, start: int, rows: int) -> tuple[int, int, int]:
        """(lo, hi, skip): the aligned byte range of the unit holding rows ``start ... start + rows``
        of the shard, and the rows' first byte within it."""
        s = self.slot
        width = shard_width(s.fsdp_param)
        first = 4 * (s.offset + start * width)
        lo = first - first % ALIGN
        hi = align_up(first + 4 * rows * width)
        return lo, hi, first - lo

    def _buffer(self, key: str, nbytes: int) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[key] = aligned_empty(nbytes, pin=False)
        return buf

    def _read(self, key: str, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """(the aligned superset read, the rows' [rows, width] view in it, its span)."""
        width = shard_width(self.slot.fsdp_param)
        lo, hi, skip = self._span(start, rows)
        buf = self._buffer(key, hi - lo)
        self.swap.io(self.unit, key, buf, write=False, span=(lo, hi)).wait()
        rows_view = buf[skip:skip + 4 * rows * width].view(torch.float32).view(rows, width)
        return buf, rows_view, (lo, hi)

    @contextlib.contextmanager
    def rows(self, start: int, rows: int) -> Iterator[torch.Tensor]:
        """Rows of the local shard, valid until the next call: from memory while the unit is resident
        (no store yet, or ``max_in_cpu`` keeps it), else from the param file."""
        swap, unit = self.swap, self.unit
        if swap.engine is not None and unit.resident:
            swap.release(unit)  # its file is current; it stays only where max_in_cpu lets it
        if rows == 0:  # a rank that owns fewer rows than the tile: nothing to read
            yield torch.zeros((0, shard_width(self.slot.fsdp_param)))
            return
        if swap.engine is None or unit.resident:
            width = shard_width(self.slot.fsdp_param)
            yield self.slot.data[start * width:(start + rows) * width].view(rows, width)
            return
        if swap.owed(unit):  # the last step's update of the whole shard first, piece by piece
            swap.update_in_file(unit)
        _, view, _ = self._read("param", start, rows)
        yield view

    def add_grad(self, start: int, grad: torch.Tensor) -> None:
        """Add a tile's reduced gradient rows into the grad file's (the first micro-step's sum
        replaces last step's values)."""
        swap, unit = self.swap, self.unit
        assert swap.engine is not None, f"{unit.name}: a gradient before the swap files exist"
        if not self._in_backward:  # the backward's first tile: the step's buffers go back (as at a unit's)
            swap.begin_grads(unit)
            self._in_backward, self._sumsq = True, 0.0
        rows = grad.shape[0]
        if rows == 0:
            return
        buf, view, span = self._read("grad", start, rows)  # read-modify-write: neighbours' rows share pages
        grad = grad.to(view.device)  # the kernel reduces on the compute device; the file's rows are host
        with torch.no_grad():
            if unit.grad_written:
                view.add_(grad.reshape(view.shape))
            else:
                view.copy_(grad.reshape(view.shape))
            self._sumsq += float(torch.linalg.vector_norm(view, dtype=torch.float32)) ** 2
        swap.io(unit, "grad", buf, write=True, span=span).wait()

    def grads_done(self) -> None:
        """Every tile's gradient is in the file: the unit's gradient is written, its norm known."""
        if not self._in_backward:
            return
        self._in_backward = False
        self.unit.grad_written = True
        self.norms.record(self.slot.index, torch.tensor([math.sqrt(self._sumsq)], dtype=torch.float32))

    def close(self) -> None:
        self._bufs = {}
