"""Host buffers pinned at their exact size, for the CPU and NVMe stores' large flat buffers.

``torch.empty(n, pin_memory=True)`` goes through torch's caching host allocator, which rounds
each block up to a power of two: 256 MiB + 4 KiB pins 512 MiB, so the stores' flat buffers
(one per state, sized by the model) could cost up to twice the host memory they use.  Here a
buffer is an anonymous ``mmap`` of exactly ``nbytes`` (page-rounded), page-locked with
``cudaHostRegister`` -- what torch's own checkpoint stager does (``torch.cuda._pin_memory_utils``)
-- and unregistered by the mapping's finalizer, which runs when the last tensor view of it is
freed (``torch.frombuffer`` keeps the mapping alive), so registration never outlives the memory.

Without CUDA the same mapping is returned unpinned (pinning needs an accelerator): page-aligned
(O_DIRECT wants 4096-byte addresses) and exact-size either way.  :func:`host_buffer_stats`
counts the bytes mapped and pinned by this module right now.
"""

from __future__ import annotations

import mmap
import threading

import torch

PAGE = mmap.PAGESIZE
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch registers it

_lock = threading.Lock()
_stats = {"mapped_bytes": 0, "pinned_bytes": 0, "buffers": 0}


def _register(ptr: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` at ``ptr`` (CUDA only); a failure names the size and the CUDA error."""
    cudart = torch.cuda.cudart()
    res = cudart.cudaHostRegister(ptr, nbytes, _PORTABLE)
    if int(res) != 0:
        raise RuntimeError(f"offload: cudaHostRegister of {nbytes} bytes of host memory failed with cudaError "
                           f"{int(res)} ({cudart.cudaGetErrorString(res)}); check free host memory and the "
                           "locked-memory limit (ulimit -l)")


def _unregister(ptr: int) -> None:
    try:  # runs from a finalizer, possibly at interpreter exit with CUDA already torn down
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - nothing left to report to
        pass


class _Mapping(mmap.mmap):
    """An anonymous mapping that unregisters itself (if pinned) before it is unmapped."""

    _ptr = 0
    _pinned = False
    _mapped = 0

    def __del__(self) -> None:
        if self._pinned:
            _unregister(self._ptr)
        with _lock:
            _stats["mapped_bytes"] -= self._mapped
            _stats["pinned_bytes"] -= self._mapped if self._pinned else 0
            _stats["buffers"] -= 1


def page_round(nbytes: int) -> int:
    """The bytes a buffer of ``nbytes`` really holds: the next multiple of the page size."""
    return -(-nbytes // PAGE) * PAGE


def pinned_empty(nbytes: int, *, pin: bool | None = None) -> torch.Tensor:
    """A page-aligned uint8 host tensor of exactly ``nbytes``, pinned when ``pin`` (default: when
    CUDA is available).  Its memory is page-rounded, never rounded to a power of two."""
    assert nbytes >= 0, nbytes
    pin = torch.cuda.is_available() if pin is None else pin
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    mapped = page_round(nbytes)
    m = _Mapping(-1, mapped, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # like malloc's: not shared on fork
    view = torch.frombuffer(m, dtype=torch.uint8)  # holds ``m``: unmapped when the last view dies
    m._ptr, m._mapped = view.data_ptr(), mapped
    with _lock:
        _stats["mapped_bytes"] += mapped
        _stats["buffers"] += 1
    if pin:
        _register(m._ptr, mapped)  # raises before _pinned is set: nothing to unregister then
        m._pinned = True
        with _lock:
            _stats["pinned_bytes"] += mapped
    del m
    out = view[:nbytes]
    assert out.data_ptr() % PAGE == 0
    return out


def pinned_tensor(numel: int, dtype: torch.dtype, *, pin: bool | None = None) -> torch.Tensor:
    """:func:`pinned_empty` viewed as ``numel`` elements of ``dtype``."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return pinned_empty(numel * itemsize, pin=pin).view(dtype)


def host_buffer_stats() -> dict[str, int]:
    """Bytes currently mapped and pinned by :func:`pinned_empty`, and the number of live buffers."""
    with _lock:
        return dict(_stats)
