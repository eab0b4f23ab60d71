"""The forkserver that :func:`deepshard.launch.local.launch_local`'s workers fork from.

It imports torch, deepshard and the workers' function once per launcher process; a spawned worker
would import them again (~5 s of CPU per rank per launch).  A launcher that starts it before its own
checks overlaps the two (the app does so right after its memory preflight).
"""

from __future__ import annotations

import multiprocessing.forkserver
import os
import sys
from collections.abc import Sequence

from deepshard.launch.parent_death import SERVER_PARENT_ENV

# what every worker imports: the server holds them before the first fork (dynamo: every optimizer step)
BASE_PRELOAD = ("deepshard.launch.forkserver_guard", "torch", "torch._dynamo", "torch.distributed.tensor",
                "deepshard.launch.local")
LAST = "deepshard.launch.forkserver_trim"  # last: see its docstring


def _quiet_resource_tracker() -> None:
    """Killed workers leak semaphores, and multiprocessing's tracker warns about them as the launcher
    exits, after the line that names the cause.  Start the tracker now, with that warning off."""
    from multiprocessing import resource_tracker

    option = "ignore:resource_tracker:UserWarning"
    sys.warnoptions.append(option)  # the tracker process is started with the interpreter's -W flags
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions.remove(option)


def start_worker_server(modules: Sequence[str] = ()) -> None:
    """Start the server, importing :data:`BASE_PRELOAD` and ``modules`` (the workers' function's module
    and what the workers import later) in the background.  Only the first call in a process starts
    one; later calls change nothing (a module they name is imported by the worker that needs it)."""
    _quiet_resource_tracker()  # the server starts the tracker: before it, with the leak warning off
    multiprocessing.set_forkserver_preload([*BASE_PRELOAD, *modules, LAST])
    os.environ[SERVER_PARENT_ENV] = str(os.getpid())  # the server dies with this process (forkserver_guard)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.pop(SERVER_PARENT_ENV, None)


def server_pid() -> int | None:
    """The server's pid: the workers' parent (it exits when the launcher does)."""
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    return pid if isinstance(pid, int) else None

