"""One deepshard job per directory: an exclusive lock file in it that names its owner.

The app takes ``<dir>/.deepshard.lock`` on its run dir and its checkpoint dir before it starts any
worker, and holds it for the job's life; a second job on either is refused (``DirectoryInUse``, a
ValueError: one line, exit 2) with the owner's pid, host and start time.  Two jobs in one directory
would delete each other's heartbeats (blinding the hang detection), overwrite each other's
checkpoints and resume from each other's saves.

The lock is ``fcntl.flock`` on the open file: the kernel drops it when its process dies, so on one
host a crashed job never blocks the next one.  The file also records the owner (host, pid, the
process's start time, job id), renewed every ``renew_s``: the refusal names it, and where flock does
not reach other hosts (some shared filesystems) the record decides, held while renewed within
``STALE_S``.  On this host a record counts only while its very process runs: a pid now held by
another process (pids are reused, e.g. after a container restart) is a dead owner.  A record of the
same job (torchelastic's run id: a restart may put global rank 0 on another host) is no rival.  A
lock left by a job that is gone (SIGKILL, a dead node) is taken over with one log line; a clean
release removes the file, and the directory if the lock created it and nothing else was written
there.  The lock file is opened without following a symlink and must be a regular file (a planted
link would have the job overwrite its target).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from deepshard.core.checkpoint.owners import process_alive, process_start
from deepshard.core.checkpoint.plain_files import open_regular

log = logging.getLogger(__name__)

LOCK_NAME = ".deepshard.lock"
RENEW_S = 10.0
STALE_S = 60.0  # a record another host has not renewed for this long belongs to a dead job
_RECORD = 512  # bytes of the record, always rewritten whole (one pwrite)


class DirectoryInUse(ValueError):
    """Another live job holds the directory's lock."""


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    started: float
    renewed: float
    job: str = ""  # torchelastic's run id, or the app's
    process: str = ""  # the process's start time (owners.process_start): pid and start name one process

    def __str__(self) -> str:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on host {self.host}, started {started}"

    def alive(self, now: float) -> bool:
        """Renewed lately and, on this host, its very process runs (the record of a killed job stays
        behind, and its pid may since belong to another process, this one included)."""
        recent = now - self.renewed < STALE_S
        if self.host != socket.gethostname():
            return recent
        # a record naming this very process without its start time was written by another process, gone,
        # that had this pid (this process's own lock is held by flock, which refused us before)
        return recent and process_alive(self.pid, self.process) and (bool(self.process) or self.pid != os.getpid())

    def same_job(self, job: str) -> bool:
        """Whether this record is ``job``'s own (an earlier attempt's, before a restart), from any host.
        torchrun's default run id "none" names no job."""
        return bool(job) and job != "none" and self.job == job


def _read(fd: int) -> Owner | None:
    try:
        record = json.loads(os.pread(fd, _RECORD, 0).decode() or "null")
        return Owner(str(record["host"]), int(record["pid"]), float(record["started"]), float(record["renewed"]),
                     str(record.get("job", "")), str(record.get("process", "")))
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):  # empty (released), half-written, foreign
        return None


def _flock(fd: int) -> bool:
    """False when another open file holds the lock; True when this one does, or the filesystem has no flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP: the record alone decides
        return True
    return True


class JobLock:
    """A held lock: renewed from a daemon thread until :meth:`release` (or the process's end)."""

    def __init__(self, path: Path, fd: int, owner: Owner, *, created: Path | None, renew_s: float) -> None:
        self.path, self.owner, self._fd, self._created = path, owner, fd, created
        self._stop = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._renew, args=(renew_s,), daemon=True, name="run-lock")
        self._thread.start()

    def _write(self) -> None:
        os.pwrite(self._fd, json.dumps(asdict(self.owner)).encode().ljust(_RECORD), 0)  # spaces: valid JSON

    def _renew(self, renew_s: float) -> None:
        while not self._stop.wait(renew_s):
            self.owner = Owner(**{**asdict(self.owner), "renewed": time.time()})
            try:
                self._write()
            except OSError:  # the directory went away: nothing left to guard
                return

    def release(self) -> None:
        if self._fd < 0:
            return
        self._stop.set()
        self._thread.join(timeout=5)
        if _is_file_at(self._fd, self.path):  # still ours (not taken over and replaced)
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self._fd)  # drops the flock
        self._fd = -1
        directory = self.path.parent
        while self._created is not None and directory.is_relative_to(self._created):
            try:
                directory.rmdir()  # only if empty: the job wrote nothing there
            except OSError:
                break
            directory = directory.parent

    def __enter__(self) -> JobLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _first_missing(directory: Path) -> Path | None:
    missing = None
    for p in (directory, *directory.parents):
        if p.exists():
            break
        missing = p
    return missing


def _is_file_at(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def acquire(directory: str | os.PathLike, *, key: str, job: str = "", renew_s: float = RENEW_S) -> JobLock:
    """Lock ``directory`` (created if missing) for this job, or raise :class:`DirectoryInUse` naming
    ``key=directory`` and the owner.  A lock of a job that is gone is taken over with a log line.  A
    directory whose lock cannot be written (a full or read-only disk) is a ValueError naming it."""
    directory = Path(os.path.abspath(directory))
    try:
        return _acquire(directory, key=key, job=job, renew_s=renew_s)
    except OSError as err:
        raise ValueError(f"{key}={directory}: the job's lock file cannot be written there "
                         f"({err.strerror or err})") from None


def _acquire(directory: Path, *, key: str, job: str, renew_s: float) -> JobLock:
    created = _first_missing(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    while True:
        fd = open_regular(path, os.O_RDWR | os.O_CREAT)  # ValueError for a symlink, a directory, a FIFO
        try:
            free = _flock(fd)
            if not _is_file_at(fd, path):  # its owner released (unlinked) it meanwhile: lock the next one
                os.close(fd)
                continue
            now = time.time()
            previous = _read(fd)
            rival = previous is not None and previous.alive(now) and not previous.same_job(job)
            if not free or rival:
                held_by = str(previous) if previous is not None else "its owner is not recorded yet"
                raise DirectoryInUse(f"{key}={directory} is in use by another deepshard job ({held_by}); "
                                     "wait for it, or use another directory")
            if previous is not None and previous.same_job(job):
                log.info("%s=%s: took over the lock of this job's earlier attempt (%s)", key, directory, previous)
            elif previous is not None:
                log.warning("%s=%s: took over the lock of a deepshard job that is gone (%s)", key, directory, previous)
            os.ftruncate(fd, 0)
            owner = Owner(socket.gethostname(), os.getpid(), now, now, job, process_start(os.getpid()))
            return JobLock(path, fd, owner, created=created, renew_s=renew_s)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
