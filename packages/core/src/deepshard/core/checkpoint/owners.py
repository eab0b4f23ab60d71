"""Who is writing a save's temp dir: the ``.owner.json`` marker (host, pid, start) a save writes
into the directories it makes, which tells a dead run's leftovers from a live concurrent save."""

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
                                              "started": time.time()}))


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


def owner_alive(directory: Path) -> tuple[bool, str]:
    """Whether the save writing ``directory`` may still be running, and who wrote it.

    Without an owner file (an older version, or a crash before it was written) it is dead; on
    another host it is taken as alive, since a process there cannot be checked from here, until it
    is older than any save takes (``OTHER_HOST_STALE_S``).
    """
    try:
        owner = json.loads((directory / OWNER).read_text())
        host, pid, started = str(owner["host"]), int(owner["pid"]), float(owner.get("started", 0))
    except (OSError, ValueError, KeyError, TypeError):
        return False, "no owner"
    if host != socket.gethostname():
        return time.time() - started < OTHER_HOST_STALE_S, f"pid {pid} on host {host}"
    return pid_alive(pid), f"pid {pid}"


