"""malloc's heap while a ZeRO-Infinity model trains: transient blocks reused, the model's never kept.

Init needs :func:`~.param_init.fixed_mmap_threshold` throughout: every shard is allocated at once
and written once, so freed shards left in the heap would add up to the model.  Mapped separately,
though, every activation and temporary over 128 KiB is page-faulted in again on each touch, which
cost ~25% of a step in compute's own kernels (2M params, 16 x 64 tokens, no offload: 0.28 s with
glibc's default, 0.36 s with every block over 128 KiB mapped).

So once every unit is on NVMe, a run whose deferred step keeps every unit resident (``buffer_count
>= units``: the model's states fit in the step's buffers, so it is compute that bounds it)
calls :func:`training_heap`: blocks up to 32 MiB come from the heap again and reuse what
the last ones freed (the step's buffers stay allocated throughout, so the backward's heap and the
forward's buffers never add up).  What scales with the model stays mapped (:func:`mapped_blocks`):
a unit's shards and FSDP's gathered params and gradients.  Larger models keep init's threshold: at
125M params in a 384 MiB cgroup (units far more than buffers) the heap held 9-13 MB more than
separate mappings at the forward's end, even with ``malloc_trim`` at every unit (fragments between
the checkpointed block inputs), and a model sized to its limit has no such margin (it no longer
fit).  Not glibc, or ``MALLOC_MMAP_THRESHOLD_`` set: nothing is tuned.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from typing import Any

from .param_init import _M_MMAP_THRESHOLD, MMAP_THRESHOLD

TRAINING_MMAP_THRESHOLD = 32 * 2**20  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)
_state: dict[str, Any] = {"libc": None, "heap": False}  # heap: training's threshold is in force


def _mallopt(nbytes: int) -> None:
    if _state["libc"] is None:
        with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to tune
            _state["libc"] = ctypes.CDLL("libc.so.6").mallopt
    if _state["libc"] is not None:
        _state["libc"](_M_MMAP_THRESHOLD, nbytes)


def training_heap(on: bool) -> None:
    """Once every unit is on NVMe (init done): with ``on``, blocks up to 32 MiB from malloc's heap
    again; else every block over 128 KiB mapped, as init left it (a later run in the same process
    may be either)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    _state["heap"] = on
    _mallopt(TRAINING_MMAP_THRESHOLD if on else MMAP_THRESHOLD)


@contextlib.contextmanager
def mapped_blocks() -> Iterator[None]:
    """Inside: every block over 128 KiB is mapped on its own (freed, it leaves the process)."""
    if not _state["heap"]:
        yield
        return
    _mallopt(MMAP_THRESHOLD)
    try:
        yield
    finally:
        _mallopt(TRAINING_MMAP_THRESHOLD)
