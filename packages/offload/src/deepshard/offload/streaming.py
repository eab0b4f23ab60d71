"""The read-ahead / write-behind loop shared by the NVMe stores: groups through a few buffers.

``fn(g, buffer)`` runs for every group in order on a buffer that ``read_io`` filled (when given);
``write_io`` then writes it back (when given).  With ``overlap`` the read of group g+1 (up to
``len(buffers) - 2`` groups ahead when buffers are free) and the write of group g-1 are in flight
while ``fn`` runs on g; without it every request is waited for as soon as it is issued.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TypeVar

from .aio import AioRequest

B = TypeVar("B")
Io = Callable[[int, B], list[AioRequest]]


def retire_write(writes: deque[tuple[B, list[AioRequest]]], *, wait: bool) -> B | None:
    """The buffer of the oldest ``(buffer, requests)`` write in ``writes``, popped once its requests
    are done (with ``wait``: once waited for); None while it is still in flight."""
    if writes and (wait or all(r.done() for r in writes[0][1])):
        buf, reqs = writes.popleft()
        for r in reqs:
            r.wait()
        return buf
    return None


def stream_groups(num_groups: int, buffers: list[B], fn: Callable[[int, B], None], *,
                  read_io: Io | None, write_io: Io | None, overlap: bool,
                  before_reuse: Callable[[B], None] | None = None,
                  assign: Callable[[int, B], None] | None = None) -> None:
    """``before_reuse(buffer)`` runs before a buffer takes a new group (device copies still reading
    it must finish); ``assign(g, buffer)`` right after (with the read ahead of group g)."""
    ahead = max(1, len(buffers) - 2) if (overlap and read_io is not None) else 0
    free = list(buffers)
    writes: deque[tuple[B, list[AioRequest]]] = deque()
    reads: dict[int, tuple[B, list[AioRequest]]] = {}

    def retire_oldest() -> None:
        buf = retire_write(writes, wait=True)
        assert buf is not None, "no buffer free and none being written"
        free.append(buf)

    def issue(g: int) -> None:
        if not free:
            retire_oldest()
        buf = free.pop()
        if before_reuse is not None:
            before_reuse(buf)
        reads[g] = (buf, read_io(g, buf) if read_io is not None else [])
        if assign is not None:
            assign(g, buf)

    try:
        for g in range(num_groups):
            if g not in reads:
                issue(g)
            for h in range(g + 1, min(num_groups, g + 1 + ahead)):
                if h not in reads:
                    if not (free or (h == g + 1 and writes)):
                        break
                    issue(h)
            buf, reqs = reads.pop(g)
            for r in reqs:
                r.wait()
            fn(g, buf)
            if write_io is not None:
                writes.append((buf, write_io(g, buf)))
                if overlap:
                    continue
                retire_oldest()
            else:
                free.append(buf)
        while writes:
            retire_oldest()
    finally:  # on error: no request may still target a buffer or a file the caller is about to reuse
        for _, reqs in list(writes) + list(reads.values()):
            for r in reqs:
                try:
                    r.wait()
                except OSError:
                    pass
