"""The host memory the offload stores allocate, stated from the constants they allocate with, so a
run's memory can be estimated before any store exists (the app's preflight and ``tools/estimate``).

- ZeRO-Infinity (``params='nvme'``): :class:`~.unit_swap.UnitSwap`'s pool of ``param_buffer_count``
  buffers of the largest gathered unit (:attr:`~.units.Unit.nbytes`), the deferred step's
  ``min(buffer_count, pieces)`` :class:`~.state_buffer.StateBuffer` s of one piece each
  (:func:`~.pieces.piece_numel`), and a tiled embedding's/head's param and gradient row buffers
  (:class:`~.tiled_shard.TiledShard`: one tile's rows, plus the alignment);
- the NVMe optimizer store alone (``device='nvme'``): ``min(buffer_count, groups)`` state buffers
  of one sub-group each (:class:`~.nvme_store.NvmeStateStore`).

A unit's layout is FSDP2's: every parameter's dim 0 padded to a multiple of the world, the padded
shards placed as the swap places them (:func:`~.units.slot_offsets`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .aio import align_up
from .config import ALIGN, OffloadConfig
from .pieces import piece_numel
from .state_buffer import buffer_bytes
from .units import slot_offsets


@dataclass(frozen=True)
class HostBuffers:
    """One rank's offload buffers in host memory, in bytes, as allocated (untouched pages of a pool
    buffer may never become resident: an upper bound on what they cost)."""

    pool: int = 0  # the parameter swap's pool
    deferred: int = 0  # the deferred AdamW step's piece buffers
    tiles: int = 0  # a tiled embedding/head's row buffers
    store: int = 0  # the NVMe optimizer store's sub-group buffers (optimizer state offload alone)
    resident: bool = False  # buffer_count >= pieces: the deferred buffers are kept through backward too

    @property
    def forward_only(self) -> int:
        """What only the forward holds: the deferred step's buffers, unless they are resident
        (``DeferredStep`` frees them at the backward's first gradient)."""
        return 0 if self.resident else self.deferred

    @property
    def peak(self) -> int:
        """All at once: the step's updates are owed from ``step()`` through the next forward (each runs
        at its unit's unshard), so the forward holds the deferred buffers beside the pool; they are
        freed at the first unit's backward (kept throughout when ``buffer_count >= pieces``)."""
        return self.pool + self.deferred + self.tiles + self.store


def unit_numel(params: Iterable[tuple[int, int]], world: int) -> int:
    """Elements of one FSDP unit's shard on a rank: ``params`` as (rows of dim 0, elements) in FSDP2's
    order, each padded to a multiple of ``world`` rows and placed by ``slot_offsets``."""
    return slot_offsets(-(-rows // world) * (numel // max(rows, 1)) for rows, numel in params)[1]


def host_buffers(config: OffloadConfig, *, state_numel: int, units: Sequence[int] = (),
                 gathered: Sequence[int] = (), tile_rows: int = 0, tile_width: int = 0,
                 world: int = 1) -> HostBuffers:
    """The host buffers of ``config``'s stores on one rank.  ``state_numel``: the optimizer's elements
    on the rank (the NVMe store's sub-groups); under ``params='nvme'``: ``units``, every unit's shard
    (:func:`unit_numel`), ``gathered`` those all-gathered whole (the pool's), and a tiled unit's
    ``tile_rows`` gathered rows of ``tile_width`` elements per tile (0: no tiling)."""
    if config.params == "nvme":
        piece = piece_numel(min(config.sub_group_size, config.buffer_size), max(units, default=0))
        pieces = sum(-(-n // piece) for n in units)
        tiles = 2 * (align_up(4 * -(-tile_rows // world) * tile_width) + ALIGN) if tile_rows else 0
        return HostBuffers(pool=config.param_buffer_count * align_up(max(gathered, default=1) * 4),
                           deferred=min(config.buffer_count, pieces) * buffer_bytes(piece), tiles=tiles,
                           resident=config.buffer_count >= pieces)
    if config.device == "nvme":
        n = max(state_numel, 1)
        group = min(config.sub_group_size, n)
        return HostBuffers(store=min(config.buffer_count, -(-n // group)) * buffer_bytes(group))
    return HostBuffers()


__all__ = ["HostBuffers", "host_buffers", "unit_numel"]
