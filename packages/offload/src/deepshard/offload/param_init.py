"""Initializing a ZeRO-3 model whose parameters live on NVMe, one unit at a time.

Core's ``initialize(materialize=...)`` runs the model's init on every shard after ``to_empty``: with
the shards freshly allocated and untouched they cost no memory until written, so a dispatch mode
watching in-place writes can send each unit to the param file and free it as soon as all its shards
have been written.  An init that writes a unit again (HF weights over the seeded init) finds it
refilled from the file first.  The mmap threshold below keeps freed shards from staying resident.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from deepshard.core.host_malloc import set_mmap_threshold

from .fsdp_hooks import lazy_init, mutates, plain_tensor
from .unit_swap import UnitSwap

MMAP_THRESHOLD = 128 * 1024


def fixed_mmap_threshold() -> None:
    """Freed shards must go back to the OS: glibc's *dynamic* mmap threshold rises to the size of
    the largest chunk freed, after which shard-sized blocks come from the heap and stay resident
    when freed, so the process would grow to the model's size.  A fixed threshold (what
    ``MALLOC_MMAP_THRESHOLD_`` sets; respected when given) maps every large block separately."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        set_mmap_threshold(MMAP_THRESHOLD)


class _InitWatch(TorchDispatchMode):
    """During initialization: refill a released unit before an op writes into it again, and flush
    a unit to NVMe once every one of its shards has been written."""

    def __init__(self, swap: UnitSwap) -> None:
        super().__init__()
        self.swap = swap

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        target = None
        if mutates(func) and args and isinstance(args[0], torch.Tensor):
            target = self.swap.slot_of(plain_tensor(args[0]))
            if target is not None and not target[0].resident:
                self.swap.ensure(target[0])
        out = func(*args, **(kwargs or {}))
        if target is not None:
            unit, slot = target
            unit.written.add(slot.offset)
            if len(unit.written) == len(unit.slots):
                self.swap.flush(unit, release=True)
        return out


def unit_by_unit(swap: UnitSwap, init_fn: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    """``materialize(model)`` for core's ``initialize``: ``init_fn(model)`` under the watch, each unit
    written to the swap's param file and freed as soon as it is initialized."""

    def materialize(model: nn.Module) -> None:
        lazy_init(model)  # FSDP re-pads shards at lazy init: do it while they exist
        swap.layout()
        try:
            with _InitWatch(swap):
                init_fn(model)
            for unit in swap.units:
                if unit.resident:
                    swap.flush(unit, release=True)
        except BaseException:
            swap.close()
            raise

    return materialize
