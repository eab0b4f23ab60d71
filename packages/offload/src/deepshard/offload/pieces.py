"""ZeRO-Infinity's pieces: the units of the parameter swap cut into bounded spans, and their I/O.

A piece is at most ``sub_group_size`` elements of one unit's flat layout (DeepSpeed's ZeRO-Infinity
sub-groups).  The optimizer (:mod:`.infinity_store`) and its deferred update (:mod:`.deferred_step`)
both move pieces between the swap files and a :class:`PieceBuffers` pool of
:class:`~.state_buffer.StateBuffer` s; this module is what they share, so neither imports the other.
Pieces start at multiples of 1024 elements (4096 bytes: O_DIRECT offsets) in a unit whose shards
start at multiples of 16: every piece of a shard starts 16-aligned in it, so torch's fused CPU
AdamW gives each element the same arithmetic as one whole-tensor update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .aio import AioRequest, align_up
from .config import ALIGN
from .state_buffer import StateBuffer
from .unit_swap import Unit, UnitSwap

PIECE_ALIGN = ALIGN // 4  # elements: a piece's file offset is a multiple of 4096 bytes
REGION = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "grad": "grad"}  # file -> buffer


@dataclass(frozen=True)
class Piece:
    """``numel`` elements of unit ``unit`` (its index) from element ``start`` of its flat layout."""

    unit: int
    start: int
    numel: int

    @property
    def nbytes(self) -> int:
        return align_up(self.numel * 4)


def piece_size(sub_group_size: int, units: list[Unit]) -> int:
    """Elements per piece of these units (:func:`piece_numel` of the largest)."""
    return piece_numel(sub_group_size, max((u.numel for u in units), default=0))


def piece_numel(sub_group_size: int, largest: int) -> int:
    """Elements per piece: ``sub_group_size`` rounded down to a multiple of :data:`PIECE_ALIGN`
    (at least one), never more than the ``largest`` unit's elements (rounded up likewise)."""
    size = max(PIECE_ALIGN, sub_group_size - sub_group_size % PIECE_ALIGN)
    return min(size, max(PIECE_ALIGN, -(-largest // PIECE_ALIGN) * PIECE_ALIGN))


def cut_pieces(units: list[Unit], size: int) -> list[Piece]:
    """Every unit cut into pieces of ``size`` elements (the last of each shorter), in unit order."""
    return [Piece(u, start, min(size, unit.numel - start))
            for u, unit in enumerate(units) for start in range(0, unit.numel, size)]


def piece_io(swap: UnitSwap, piece: Piece, buf: StateBuffer, keys: tuple[str, ...], *,
             write: bool) -> list[AioRequest]:
    """The piece's bytes of each file in ``keys`` between the file and its region of ``buf``."""
    lo = 4 * piece.start
    unit = swap.units[piece.unit]
    out = []
    for k in keys:
        start = buf.f32[REGION[k]].data_ptr() - buf.raw.data_ptr()
        out.append(swap.io(unit, k, buf.raw[start:start + piece.nbytes], write=write, span=(lo, lo + piece.nbytes)))
    return out


class PieceBuffers:
    """The step's buffers of one piece each: allocated when a step needs them, given back between a
    backward's first gradient and the next step (unless resident, see :mod:`.deferred_step`)."""

    def __init__(self, *, piece_numel: int, count: int) -> None:
        self.piece_numel = piece_numel
        self.count = count
        self.buffers: list[StateBuffer] = []

    def ensure(self) -> None:
        if not self.buffers:
            self.buffers = [StateBuffer(self.piece_numel, torch.cuda.is_available()) for _ in range(self.count)]

    def free(self) -> None:
        self.buffers = []
