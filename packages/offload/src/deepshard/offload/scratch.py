"""Swap files are scratch: they go away on close, at exit, on SIGINT/SIGTERM, and after crashes.

Layout: ``<nvme_path>/deepshard-<run_id>/rank<k>/store<n>/`` (``n`` counts the stores of one
process, e.g. one per pipeline stage).  The run id is the launcher's (its run id
or pid), so the launcher can call :func:`remove_scratch` after its workers die, and each store dir
records its owner pid so a later run can sweep dirs of dead processes (:func:`remove_stale_scratch`).
Removal is only ever done by the process that created a dir: forked children (DataLoader workers)
inherit the registry and the signal handlers but must not delete their parent's files.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import threading
from pathlib import Path

from deepshard.core.checkpoint.owners import pid_alive
from deepshard.core.checkpoint.plain_files import write_text

log = logging.getLogger(__name__)

PREFIX = "deepshard-"
OWNER_FILE = "owner.pid"

_registry: dict[str, int] = {}  # dir -> pid of the process that owns it
_lock = threading.RLock()  # re-entrant: the signal handler may interrupt a holder in the main thread
_previous: dict[int, object] = {}
_installed = False
_num_stores = 0


def run_dir(nvme_path: str | os.PathLike, run_id: str) -> Path:
    """The per-run scratch directory under ``nvme_path``."""
    if not run_id or os.sep in run_id or run_id in (".", ".."):
        raise ValueError(f"offload: run_id={run_id!r} is invalid; expected a non-empty name without '{os.sep}'")
    return Path(nvme_path) / f"{PREFIX}{run_id}"


def make_store_dir(nvme_path: str | os.PathLike, run_id: str, rank: int) -> Path:
    """Create ``deepshard-<run_id>/rank<k>/store<n>``, record this pid as owner, arm the cleanup hooks."""
    global _num_stores
    with _lock:
        n = _num_stores
        _num_stores += 1
    path = run_dir(nvme_path, run_id) / f"rank{rank}" / f"store{n}"
    path.mkdir(parents=True, exist_ok=True)
    write_text(path / OWNER_FILE, str(os.getpid()))
    register(path)
    return path


def register(path: str | os.PathLike) -> None:
    """Remove ``path`` at exit or on SIGINT/SIGTERM unless :func:`unregister` ran first."""
    _install_hooks()
    with _lock:
        _registry[str(path)] = os.getpid()


def unregister(path: str | os.PathLike) -> None:
    with _lock:
        _registry.pop(str(path), None)


def remove_dir(path: str | os.PathLike) -> None:
    """Delete a store dir, then its rank and run dirs if they are now empty."""
    shutil.rmtree(path, ignore_errors=True)
    for parent in (Path(path).parent, Path(path).parent.parent):
        try:
            os.rmdir(parent)
        except OSError:
            return  # other stores' or ranks' dirs still there, or already gone


def cleanup_all() -> None:
    """Remove every dir this process registered (not ones inherited across fork)."""
    with _lock:
        mine = [p for p, pid in _registry.items() if pid == os.getpid()]
        for p in mine:
            del _registry[p]
    for p in mine:
        remove_dir(p)


def _on_signal(signum: int, frame: object) -> None:
    cleanup_all()
    prev = _previous.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
    elif prev != signal.SIG_IGN:  # SIG_DFL (or unknown, set from C): die the way the signal says
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_hooks() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
    atexit.register(cleanup_all)
    if threading.current_thread() is not threading.main_thread():
        log.warning("offload: swap store created off the main thread; SIGINT/SIGTERM cleanup not armed")
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        _previous[sig] = signal.getsignal(sig)
        signal.signal(sig, _on_signal)


def remove_scratch(nvme_path: str | os.PathLike, run_id: str) -> bool:
    """For the launcher: delete a run's scratch dir after its workers ended (or crashed).

    Returns whether anything was removed.
    """
    path = run_dir(nvme_path, run_id)
    if not path.exists():
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True




def remove_stale_scratch(nvme_path: str | os.PathLike) -> list[Path]:
    """Delete run dirs under ``nvme_path`` whose every store's owner process is gone (same host)."""
    removed = []
    root = Path(nvme_path)
    if not root.is_dir():
        return removed
    for run in root.glob(f"{PREFIX}*"):
        owners = []
        for owner in run.glob(f"rank*/store*/{OWNER_FILE}"):
            try:
                owners.append(int(owner.read_text()))
            except (OSError, ValueError):
                continue
        if owners and not any(pid_alive(pid) for pid in owners):
            shutil.rmtree(run, ignore_errors=True)
            removed.append(run)
    return removed
