"""The parameter swap's units and slots: what an FSDP2 unit is in the swap files, and the protocol of
the optimizer's deferred update, shared by the swap (:mod:`.unit_swap`), its hooks and the optimizer
(:mod:`.deferred_step`) so none of them imports another for its types.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .aio import AioRequest, align_up
from .fsdp_hooks import shard_data
from .state_buffer import VEC  # every shard starts on a 64-byte line (torch's fused CPU AdamW unit)

FILES = ("param", "exp_avg", "exp_avg_sq", "grad")


class Deferred(Protocol):
    """The optimizer's update of each unit, deferred until the unit is next needed (the next
    forward's unshard): :class:`~.deferred_step.DeferredStep` implements it."""

    def owes(self, unit: Unit) -> bool: ...
    def reading(self, unit: Unit) -> bool: ...
    def held(self, unit: Unit) -> list[tuple[int, torch.Tensor]] | None: ...
    def grad_region(self, unit: Unit) -> tuple[list[tuple[int, torch.Tensor]], bool] | None: ...
    def keep_grad(self, unit: Unit) -> None: ...
    def drop_grads(self) -> None: ...
    def read_ahead(self, unit: Unit) -> bool: ...
    def apply(self, unit: Unit, *, land: bool) -> None: ...
    def drain(self) -> None: ...
    def flush_writes(self) -> None: ...
    def idle(self) -> None: ...


def slot_offsets(numels: Iterable[int]) -> tuple[list[int], int]:
    """Where each of a unit's padded shards (``numels`` elements, in FSDP2's order) starts in the unit,
    each at a multiple of ``VEC``, and the unit's length in elements."""
    starts, pos = [], 0
    for n in numels:
        pos = -(-pos // VEC) * VEC
        starts.append(pos)
        pos += n
    return starts, pos


@dataclass
class Slot:
    """One FSDPParam's place in its unit: ``numel`` padded elements from ``offset``; the first
    ``local_numel`` are the shard the optimizer updates; ``index`` in the store's param list."""

    fsdp_param: Any
    offset: int
    numel: int
    local_numel: int
    index: int

    @property
    def data(self) -> torch.Tensor:
        return shard_data(self.fsdp_param)


@dataclass
class Unit:
    name: str
    group: Any  # FSDPParamGroup
    slots: list[Slot] = field(default_factory=list)
    numel: int = 0
    offset: int = 0  # bytes into every swap file
    resident: bool = True  # materialized params start in memory (written to the file on open)
    pending: tuple[torch.Tensor, list[AioRequest]] | None = None  # a read in flight into a pool buffer
    grad_written: bool = False  # this step's gradient (so far) is in the grad file
    written: set[int] = field(default_factory=set)  # slots the materializer saw written
    tiled: bool = False  # never all-gathered (vocabulary tiling): read and written in rows, not whole

    @property
    def nbytes(self) -> int:
        return align_up(self.numel * 4)
