"""Asynchronous file I/O with stdlib O_DIRECT preadv/pwritev on a thread pool.

Measured on this project's CPU host, this matched fio/libaio/io_uring with the least CPU: the
syscalls release the GIL, so a few threads keep the disk busy while the main thread runs Adam.
O_DIRECT needs 4096-aligned buffer addresses, lengths and offsets: :func:`aligned_empty` gives
such buffers and the swap layout keeps every offset and length a multiple of 4096.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from deepshard.core.checkpoint.plain_files import open_regular

from .config import ALIGN, AioConfig
from .pinned import pinned_empty

log = logging.getLogger(__name__)


def align_up(nbytes: int) -> int:
    """Round a byte count up to the O_DIRECT alignment."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose data pointer is 4096-aligned (torch.empty's is not).

    Page-aligned memory of exactly ``nbytes`` (page-rounded) from :func:`pinned_empty`; pinned
    with ``pin`` without the caching host allocator's power-of-two rounding.
    """
    out = pinned_empty(nbytes, pin=pin)
    assert nbytes == 0 or out.data_ptr() % ALIGN == 0
    return out


def as_buffer(t: torch.Tensor) -> memoryview:
    """Zero-copy writable buffer over a contiguous CPU tensor (bf16 has no numpy dtype: go via uint8)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


class SwapFile:
    """A preallocated file opened O_DIRECT, or buffered if the filesystem refuses O_DIRECT (tmpfs)."""

    def __init__(self, path: str, nbytes: int, *, direct: bool = True) -> None:
        self.path = path
        self.nbytes = nbytes
        flags = os.O_RDWR | os.O_CREAT
        self.direct = direct and hasattr(os, "O_DIRECT")
        if self.direct:
            try:
                self.fd = open_regular(path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._fall_back(e)
        if not self.direct:
            self.fd = open_regular(path, flags, 0o600)  # never through a link
        try:
            os.posix_fallocate(self.fd, 0, max(nbytes, ALIGN))  # real blocks: overwrites are ~2x faster
        except OSError as e:
            os.close(self.fd)
            raise OSError(e.errno, f"cannot preallocate {nbytes} bytes for swap file {path}: {e.strerror}") from e
        if self.direct:
            self._probe()

    def _fall_back(self, err: OSError) -> None:
        log.warning("O_DIRECT refused at %s (%s); using buffered I/O (page cache) for swap files",
                    self.path, err)
        self.direct = False

    def _probe(self) -> None:
        """Some filesystems accept O_DIRECT at open and refuse it at I/O: try one aligned block."""
        buf = as_buffer(aligned_empty(ALIGN))
        try:
            os.pwritev(self.fd, [buf], 0)
            os.preadv(self.fd, [buf], 0)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            os.close(self.fd)
            self._fall_back(e)
            self.fd = open_regular(self.path, os.O_RDWR, 0o600)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class AioRequest:
    """One read or write of a contiguous buffer; :meth:`wait` re-raises the first chunk error."""

    def __init__(self, num_tasks: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._left = num_tasks
        self._error: BaseException | None = None
        self._done = threading.Event()
        if num_tasks == 0:
            self._done.set()

    def _finish_task(self, error: BaseException | None) -> bool:
        if error is not None and self._error is None:
            self._error = error
        self._left -= 1  # called under the engine lock
        if self._left == 0:
            self._done.set()
            return True
        return False

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


def _run_chunks(fd: int, chunks: list[tuple[memoryview, int]], write: bool) -> None:
    op = os.pwritev if write else os.preadv
    for view, offset in chunks:
        done = 0
        while done < len(view):
            n = op(fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, f"{'write' if write else 'read'} of {len(view)} bytes at "
                                         f"offset {offset} stopped after {done} bytes")
            done += n


class AioEngine:
    """Issues reads/writes as chunked syscalls on ``thread_count`` threads, at most ``queue_depth``
    submissions in flight; keeps byte counts and busy time per direction for benchmarks."""

    def __init__(self, cfg: AioConfig) -> None:
        self.cfg = cfg
        self._pool = ThreadPoolExecutor(max_workers=cfg.thread_count, thread_name_prefix="deepshard-aio")
        self._lock = threading.Lock()
        self._queue: deque = deque()
        self._inflight = 0
        self._active = {True: 0, False: 0}
        self._since = {True: 0.0, False: 0.0, None: 0.0}  # None: either direction
        self.busy_s = {True: 0.0, False: 0.0, None: 0.0}  # key: is_write (None: any I/O in flight)
        self.bytes = {True: 0, False: 0}

    def read(self, fd: int, buf: memoryview, offset: int) -> AioRequest:
        """Fill ``buf`` from ``fd`` at ``offset`` asynchronously."""
        return self._submit(fd, buf, offset, write=False)

    def write(self, fd: int, buf: memoryview, offset: int) -> AioRequest:
        """Write ``buf`` to ``fd`` at ``offset`` asynchronously (``buf`` must stay untouched until done)."""
        return self._submit(fd, buf, offset, write=True)

    def _submit(self, fd: int, buf: memoryview, offset: int, *, write: bool) -> AioRequest:
        bs = self.cfg.block_size
        chunks = [(buf[o:o + bs], offset + o) for o in range(0, len(buf), bs)]
        if self.cfg.single_submit:
            tasks = [[c] for c in chunks]
        else:
            n = min(self.cfg.thread_count, len(chunks))
            per = -(-len(chunks) // n) if n else 0
            tasks = [chunks[i:i + per] for i in range(0, len(chunks), per)] if n else []
        req = AioRequest(len(tasks), len(buf))
        with self._lock:
            self.bytes[write] += len(buf)
            if tasks:
                now = time.perf_counter()
                if self._active[write] == 0:
                    self._since[write] = now
                if self._active[True] + self._active[False] == 0:
                    self._since[None] = now
                self._active[write] += 1
            self._queue.extend((fd, t, write, req) for t in tasks)
            self._pump()
        return req

    def _pump(self) -> None:
        # under self._lock
        while self._queue and self._inflight < self.cfg.queue_depth:
            fd, chunks, write, req = self._queue.popleft()
            self._inflight += 1
            self._pool.submit(self._task, fd, chunks, write, req)

    def _task(self, fd: int, chunks: list, write: bool, req: AioRequest) -> None:
        error: BaseException | None = None
        try:
            _run_chunks(fd, chunks, write)
        except BaseException as e:  # handed to the waiter, never lost in the pool
            error = e
        with self._lock:
            self._inflight -= 1
            if req._finish_task(error):
                self._active[write] -= 1
                now = time.perf_counter()
                if self._active[write] == 0:
                    self.busy_s[write] += now - self._since[write]
                if self._active[True] + self._active[False] == 0:
                    self.busy_s[None] += now - self._since[None]
            self._pump()

    def reset_stats(self) -> None:
        with self._lock:
            self.busy_s = {True: 0.0, False: 0.0, None: 0.0}
            self.bytes = {True: 0, False: 0}
            now = time.perf_counter()
            self._since = {True: now, False: now, None: now}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
