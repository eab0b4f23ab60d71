"""Who is writing a save's temp dir: the ``.owner.json`` marker (host, pid, the process's start time) a
save writes into the directories it makes, which tells a dead run's leftovers from a live concurrent
save; and how a pid and start time name one process on this host (pids are reused)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from deepshard.core.checkpoint.plain_files import write_text

OWNER = ".owner.json"  # who is writing a temp dir (host, pid): tells a dead run's leftovers from a live save
OTHER_HOST_STALE_S = 6 * 3600  # a temp dir another host started this long ago belongs to a dead run


def write_owner(directory: Path) -> None:
    """Mark ``directory`` as being written by this process (see :func:`temp_dirs`)."""
    write_text(directory / OWNER, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                              "started": time.time(), "process": process_start(os.getpid())}))


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this host (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (killed, never reaped: containers without an init) is dead too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def process_start(pid: int) -> str:
    """When process ``pid`` started, as ``<boot id>/<clock ticks since boot>`` ("" if it is not running or
    unknown): with the pid it names one process, where a pid alone may since belong to another (pids
    are reused; a restarted container hands out the same small pids again)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        ticks = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]  # field 22: starttime
    except (OSError, IndexError):
        return ""
    return f"{boot}/{ticks}"


def process_alive(pid: int, started: str) -> bool:
    """Whether the process that was ``pid``, started at ``started`` (:func:`process_start`; "" when its
    record, an older one, has none: then the pid alone decides), runs on this host."""
    return pid_alive(pid) and (not started or process_start(pid) == started)


def owner_alive(directory: Path) -> tuple[bool, str]:
    """Whether the save writing ``directory`` may still be running, and who wrote it.

    Without an owner file (an older version, or a crash before it was written) it is dead; on
    another host it is taken as alive, since a process there cannot be checked from here, until it
    is older than any save takes (``OTHER_HOST_STALE_S``).
    """
    try:
        owner = json.loads((directory / OWNER).read_text())
        host, pid, started = str(owner["host"]), int(owner["pid"]), float(owner.get("started", 0))
        process = str(owner.get("process", ""))
    except (OSError, ValueError, KeyError, TypeError):
        return False, "no owner"
    if host != socket.gethostname():
        return time.time() - started < OTHER_HOST_STALE_S, f"pid {pid} on host {host}"
    return process_alive(pid, process), f"pid {pid}"


