"""``MALLOC_MMAP_THRESHOLD_`` (the app's ``launcher.malloc_mmap_threshold``) reaches the workers.

glibc reads it once, when a process starts; workers fork from a server that started before the
launcher set it, so the worker itself must apply it.  Observed in glibc's own count of mapped bytes
(``mallinfo2().hblkhd``): after a 16 MiB block was mapped and freed (which raises glibc's *dynamic*
threshold to that size; blocks over 32 MiB leave it alone), a 1 MiB tensor is mapped on its own only if
the fixed threshold below 1 MiB is in force; otherwise it comes from the heap.
"""

from __future__ import annotations

import ctypes
import os

import pytest

from deepshard.launch.local import launch_local, start_worker_server

pytestmark = pytest.mark.slow  # a launch of its own


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _own_mapping_of_a_fresh_mib() -> bool:
    import torch

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.mallinfo2.restype = _Mallinfo2
    libc.free(ctypes.c_void_p(libc.malloc(16 << 20)))  # a mapped block freed: the dynamic threshold rises to 16 MiB
    mapped = libc.mallinfo2().hblkhd
    t = torch.empty(1 << 20, dtype=torch.uint8)
    grown = libc.mallinfo2().hblkhd - mapped
    del t
    return grown >= 1 << 20  # a mapping of its own


def test_a_threshold_set_after_the_server_started_is_in_force_in_the_workers(monkeypatch):
    start_worker_server(_own_mapping_of_a_fresh_mib)  # already running in a long session: the case that matters
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    before = dict(os.environ)
    assert launch_local(_own_mapping_of_a_fresh_mib, 1, threads_per_worker=2) == [True]
    # the launching process keeps its environment: the workers' OMP_NUM_THREADS, and what torch's elastic
    # agent writes there itself (TORCHELASTIC_SIGNALS_TO_HANDLE), stay out of it
    assert dict(os.environ) == before
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert launch_local(_own_mapping_of_a_fresh_mib, 1) == [False]  # the check sees the difference
