"""glibc's malloc tuning for a process that frees large host blocks (shards, staging buffers).

Its own module, free of torch: the launcher sets it before its workers start and must not import
the engine to do so."""

from __future__ import annotations

import contextlib
import ctypes

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def set_mmap_threshold(nbytes: int) -> None:
    """glibc's fixed mmap threshold (``mallopt(M_MMAP_THRESHOLD)``, what ``MALLOC_MMAP_THRESHOLD_`` sets at a
    process's start): blocks this large or larger are mapped on their own and go back to the OS when freed
    (the dynamic threshold rises to the largest block freed, after which freed shards stay resident)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to tune
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, nbytes)
