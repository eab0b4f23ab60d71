"""Which worker died first, and of what: the agent's own record, for naming a failure's first cause.

torch's elastic agent looks at its workers every ``monitor_interval`` and reports one failed worker:
of those dead by then, the lowest local rank.  A rank SIGKILLed and its peer that fails a moment later
on the lost connection ("Connection closed by peer") are often both dead by the time it looks, and
the peer, the consequence, is reported.  :class:`DeathWatch` sees each death as it happens: on
SIGCHLD (in the main thread, before the agent's monitor can reap anything) it peeks at every
child that has exited (``waitid`` with ``WNOWAIT``, leaving it for the agent to reap) and records its
pid, the order it was seen in, and its signal or exit status.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# what a rank sees when a peer it talks to is gone: a consequence, not a cause
COMM_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "Connection closed by peer",
               "Connection reset by peer", "Broken pipe", "Timed out", "timed out")


def lost_peer(message: str) -> bool:
    """Whether an error message says a peer is gone (a consequence of its end, not a cause)."""
    return any(s in message for s in COMM_ERRORS)


@dataclass(frozen=True)
class Death:
    pid: int
    seen: int  # deaths seen together (one SIGCHLD) share a number; lower: earlier
    signal: int  # the signal that ended it, or 0 when it exited
    status: int  # its exit status when it exited


def _children() -> list[int]:
    """This process's child pids: the kernel's children lists where it keeps them, else every process's
    parent pid (``/proc/PID/stat``)."""
    me, pids, listed = os.getpid(), [], False
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
            listed = True
        except (OSError, ValueError):
            continue
    if listed:
        return pids
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                    pids.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                continue
    return pids


class DeathWatch:
    """Records this process's children as they die (see the module docstring); a context manager that
    installs its SIGCHLD handler (main thread only: elsewhere, and without ``/proc``, it records nothing)."""

    def __init__(self) -> None:
        self.deaths: dict[int, Death] = {}
        self._seen = 0
        self._previous: Any = None
        self._on = False

    def __enter__(self) -> DeathWatch:
        if threading.current_thread() is threading.main_thread() and Path("/proc/self/task").is_dir():
            self._previous = signal.signal(signal.SIGCHLD, self._look)
            self._on = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._on:
            signal.signal(signal.SIGCHLD, self._previous if self._previous is not None else signal.SIG_DFL)
            self._on = False

    def clear(self) -> None:
        """Forget every death (the agent restarts its workers: a new attempt's cause is its own)."""
        self.deaths.clear()

    def _look(self, signum: int = 0, frame: Any = None) -> None:
        self._seen += 1
        for pid in _children():
            if pid in self.deaths:
                continue
            try:
                got = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped meanwhile
                continue
            if got is None or got.si_pid == 0:
                continue
            killed = got.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
            self.deaths[pid] = Death(pid, self._seen, got.si_status if killed else 0,
                                     0 if killed else got.si_status)

    def first_killed(self, ranks: dict[int, int]) -> tuple[int, Death] | None:
        """``(rank, death)`` of the worker killed by a signal (other than the SIGTERM/SIGINT an agent stops
        its workers with) among the first deaths seen, if it was one; ``ranks`` maps pid to rank."""
        known = [d for d in self.deaths.values() if d.pid in ranks]
        if not known:
            return None
        first = min(d.seen for d in known)
        killed = [d for d in known if d.seen == first and d.signal and d.signal not in (signal.SIGTERM, signal.SIGINT)]
        if not killed:
            return None
        death = min(killed, key=lambda d: ranks[d.pid])
        return ranks[death.pid], death
