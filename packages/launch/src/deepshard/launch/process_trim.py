"""Give back what a process no longer uses: Python's garbage, then glibc's free heap pages.

glibc keeps freed memory in its arenas (the main heap only shrinks from its top), so a process that
imported and parsed a lot and then dropped it stays as big as its peak; ``malloc_trim(0)`` returns
every free page of every arena.  A no-op where the C library has no ``malloc_trim`` (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def _libc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """gc.collect(), then glibc's ``malloc_trim(0)``; whether the C library trimmed."""
    gc.collect()
    trim = _libc_trim()
    return bool(trim is not None and trim(0))
