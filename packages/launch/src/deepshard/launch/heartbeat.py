"""Which rank is stuck, and where: per-rank heartbeat files and the launcher's watchdog over them.

Each worker's ``Heartbeat`` writes its current step and phase, with the time, to ``<dir>/rank<R>.json``
at every ``mark`` and from a daemon thread every ``interval_s``: one fixed-size ``pwrite`` over the
same bytes (microseconds; a reader that catches a write half done skips it until the next poll).  Two facts
come out of a file: ``beat`` (the process is alive: a SIGSTOPped or GIL-frozen rank stops beating)
and ``since`` (when it last made progress).  A rank blocked in a collective keeps beating, so when
one rank hangs the others are not blamed: the watchdog names a rank that stopped beating, else the
one furthest behind.  A checkpoint save reports its written bytes (``progress``, wired by the app to
``deepshard.core.checkpoint.progress``) as ``wrote``: a save that writes, however slowly, is progress
for every rank (they wait on each other inside the collective save); one that writes nothing for
``hang_s`` is a hang like any other.  Each file names its process (host, pid, start time): the launcher
removes an earlier run's files before it starts, and never those of a process that still runs (another job's).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deepshard.core.checkpoint.owners import OWNER, owner_alive, process_alive, process_start, write_owner
from deepshard.core.checkpoint.plain_files import open_regular

ENV_DIR = "DEEPSHARD_HEARTBEAT_DIR"
_RECORD = 1024  # bytes of a heartbeat file, always rewritten whole (a 253-byte host name still fits)
# the order a step goes through; "startup" is not judged for progress (loading can take long)
PHASES = ("startup", "forward", "backward", "optimizer", "eval", "checkpoint", "done")


class Heartbeat:
    """One rank's beat; a no-op without a directory (a run not started by the local launcher)."""

    def __init__(self, directory: str | None, rank: int, *, interval_s: float = 0.5) -> None:
        self.path = Path(directory) / f"rank{rank}.json" if directory else None
        self.rank = rank
        self.step = 0
        self.phase = "startup"
        self.since = time.time()
        self.marks = 0
        self.wrote = 0.0  # when a save last reported written bytes (0: never)
        self.wrote_bytes = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._fd = -1
        self._host = socket.gethostname()
        self._process = process_start(os.getpid())
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = open_regular(self.path, os.O_WRONLY | os.O_CREAT)  # never through a link, never a FIFO
            os.ftruncate(self._fd, 0)
            self._write()
            threading.Thread(target=self._run, args=(interval_s,), daemon=True, name="heartbeat").start()

    @classmethod
    def from_env(cls, rank: int) -> Heartbeat:
        return cls(os.environ.get(ENV_DIR), rank)

    def mark(self, phase: str, step: int) -> None:
        """Entering ``phase`` of ``step`` (progress)."""
        assert phase in PHASES, phase
        self.phase, self.step, self.since = phase, step, time.time()
        self.marks += 1
        if self.path is not None:
            self._write()

    def progress(self, nbytes: int) -> None:
        """A checkpoint writer wrote ``nbytes`` (from any thread): progress, carried by the next beat."""
        self.wrote, self.wrote_bytes = time.time(), self.wrote_bytes + nbytes

    def _write(self) -> None:
        assert self.path is not None
        with self._lock:  # the loop's marks and the beat thread share the file
            state = {"rank": self.rank, "pid": os.getpid(), "step": self.step, "phase": self.phase,
                     "since": self.since, "marks": self.marks, "beat": time.time(), "host": self._host,
                     "process": self._process, "wrote": self.wrote, "wrote_bytes": self.wrote_bytes}
            os.pwrite(self._fd, json.dumps(state).encode().ljust(_RECORD), 0)  # trailing spaces: valid JSON

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self._write()
            except OSError:  # the run dir went away: nothing to report to
                return

    def close(self) -> None:
        """Phase ``done``: this rank is no longer judged."""
        self._stop.set()
        self.mark("done", self.step)


@dataclass(frozen=True)
class Hang:
    rank: int
    step: int
    phase: str
    stalled_s: float
    frozen: bool  # stopped beating (SIGSTOP, a GIL held forever), not just waiting
    pid: int = 0  # the blamed rank's process

    def __str__(self) -> str:
        return (f"rank {self.rank} has made no progress since step {self.step} ({self.phase}) for "
                f"{self.stalled_s:.0f} s")


def read_beats(directory: str | Path) -> list[dict]:
    beats = []
    for f in sorted(Path(directory).glob("rank*.json")):
        try:
            beats.append(json.loads(f.read_text()))
        except (OSError, ValueError):  # mid-replace or gone: next poll
            continue
    return beats


def _running(beat: dict, now: float, other_host_stale_s: float) -> bool:
    """Whether the process that writes ``beat`` may still run: on this host its pid and start time say
    (a stopped, hung rank runs; a pid since reused by another process does not); another host's
    process cannot be checked from here: its recent beat says."""
    host = beat.get("host", socket.gethostname())  # files of older versions: written on this host
    if host != socket.gethostname():
        return now - float(beat.get("beat", 0)) < other_host_stale_s
    return process_alive(int(beat["pid"]), str(beat.get("process", "")))


def remove_dead_beats(directory: str | Path, *, other_host_stale_s: float = 60.0) -> list[tuple[Path, dict]]:
    """Remove the heartbeat files of processes that are gone (an earlier run's: their pids must never
    be judged or killed); returns the files of live ones, left in place."""
    live = []
    now = time.time()
    for f in sorted(Path(directory).glob("rank*.json")):
        beat = _read_settled(f)
        if beat is not None and _running(beat, now, other_host_stale_s):
            live.append((f, beat))
        else:
            f.unlink(missing_ok=True)
    return live


def agent_beat_dir(run_id: str, *, root: str | None = None) -> str:
    """A fresh heartbeat directory for the agent in the temp dir (``root``), marked with its owner: the
    agent removes it when it ends, but a SIGKILLed agent cannot, so each one first removes those of
    agents that are gone (:func:`remove_stale_beat_dirs`)."""
    remove_stale_beat_dirs(root)
    directory = tempfile.mkdtemp(prefix=f"deepshard-{run_id}-heartbeat-", dir=root)
    write_owner(Path(directory))
    return directory


def remove_stale_beat_dirs(root: str | None = None, *, unmarked_after_s: float = 3600.0) -> list[Path]:
    """Remove the agents' heartbeat directories in ``root`` (the temp dir) whose owner is gone; one with no
    owner marker (being made, or an older version's) only once it is ``unmarked_after_s`` old and no
    process that wrote a heartbeat in it runs.  Returns what it removed."""
    removed = []
    now = time.time()
    for d in sorted(Path(root or tempfile.gettempdir()).glob("deepshard-*-heartbeat-*")):
        try:
            if not d.is_dir() or d.is_symlink():
                continue
            marked = (d / OWNER).is_file()
            if owner_alive(d)[0] if marked else (now - d.stat().st_mtime < unmarked_after_s or any(
                    _running(beat, now, 0.0) for beat in read_beats(d))):
                continue
        except OSError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
    return removed


def _read_settled(f: Path, tries: int = 3) -> dict | None:
    """The file's beat; a read that caught a write half done is retried.  None: no process to protect."""
    for _ in range(tries):
        try:
            beat = json.loads(f.read_text())
            int(beat["pid"])
            return beat
        except (ValueError, KeyError, TypeError):
            time.sleep(0.05)
        except OSError:
            return None
    return None


QUIET_S = 2.0  # four beats missed at the default interval: the rank's beat thread is not running


def find_hang(beats: list[dict], hang_s: float, now: float) -> Hang | None:
    """The rank to blame once some rank made no progress for ``hang_s``: one that stopped beating,
    else the one furthest behind (lowest step and phase), ties broken by the oldest progress.  Bytes a
    save wrote on any rank are progress of every rank (they wait on each other in the save)."""
    live = [b for b in beats if b["phase"] != "done"]
    saving = max((float(b.get("wrote", 0.0)) for b in live), default=0.0)

    def last_progress(b: dict) -> float:
        return max(b["since"], saving)

    frozen = [b for b in live if now - b["beat"] > hang_s]
    stalled = [b for b in live if b["phase"] != "startup" and now - last_progress(b) > hang_s]
    if not frozen and not stalled:
        return None
    # a rank that waits in a collective for a stopped peer can stall a moment before the peer's last beat is
    # hang_s old: a beat thread silent for QUIET_S already says which rank stopped (else the waiter is blamed)
    quiet = [b for b in live if now - b["beat"] > min(hang_s, QUIET_S)]
    pool = frozen or quiet or live
    b = min(pool, key=lambda b: (b["step"], PHASES.index(b["phase"]), b["since"]))
    return Hang(rank=b["rank"], step=b["step"], phase=b["phase"], stalled_s=now - last_progress(b),
                frozen=bool(frozen), pid=int(b["pid"]))


class Watchdog:
    """In the launcher: polls the heartbeat files; on a hang records it and SIGKILLs every worker
    (a stopped process ignores SIGTERM until continued), so the launch returns with the workers' deaths."""

    def __init__(self, directory: str | Path, hang_s: float, *, poll_s: float = 0.5,
                 kill: Callable[[int, int], None] = os.kill) -> None:
        self.directory = Path(directory)
        self.hang_s = hang_s
        self.poll_s = poll_s
        self.kill = kill
        self.hang: Hang | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="watchdog")

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        # it keeps watching after a kill: under --max_restarts the restarted workers can hang too, and the
        # files of the killed ones (until their successors rewrite them) are never judged again
        while not self._stop.wait(self.poll_s):
            now = time.time()
            beats = [b for b in read_beats(self.directory) if _running(b, now, math.inf)]
            hang = find_hang(beats, self.hang_s, now)
            if hang is None:
                continue
            self.hang = hang
            for b in beats:
                try:
                    self.kill(int(b["pid"]), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
