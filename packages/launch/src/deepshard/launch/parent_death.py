"""Workers end with their launcher: no orphan keeps training, or holding memory and GPUs, after a
``kill -9`` of the job leader (an OOM killer, a scheduler).

torch's elastic agent stops its workers when it is stopped by a signal it can catch, but a SIGKILL
of the agent's process leaves them running.  Each worker therefore asks the kernel for a SIGKILL
when its parent ends (``prctl(PR_SET_PDEATHSIG)``, Linux), then checks that its parent is still
the one expected: a parent that ended between the fork and the ``prctl`` sends no signal.  The
signal is SIGKILL, not SIGTERM: a script's own SIGTERM handler (the app saves a checkpoint on it)
would keep an orphan alive with nobody left to watch it.  A node started over ssh has no parent of
its own on that host (sshd's session is): it ends when its ssh session closes, seen as the end of
its standard input (:func:`end_with_stdin`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1  # linux/prctl.h
SERVER_PARENT_ENV = "DEEPSHARD_FORKSERVER_PARENT"  # see forkserver_guard

# run by ``python -I -c`` in front of every worker of the ``deepshard`` command: argv[1] the parent
# pid expected, argv[2:] the worker's command, exec'd (the parent-death signal survives exec)
GUARD = """import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGKILL)
try:  # out of memory a worker dies first, not its agent (deepshard.launch.memory.raise_oom_score)
    with open("/proc/self/oom_score_adj", "r+") as f:
        adj = int(f.read() or 0); f.seek(0); f.write(str(min(1000, adj + 500)))
except (OSError, ValueError):
    pass
os.execvp(sys.argv[2], sys.argv[2:])
"""


def guarded(entry: str, args: Sequence[str], parent: int) -> tuple[str, list[str]]:
    """The command ``(executable, arguments)`` that runs ``entry args`` as a child of ``parent``
    which dies with it (about 20 ms more per worker start)."""
    return sys.executable, ["-I", "-c", GUARD, str(parent), entry, *args]


def die_with_parent(expected_parent: int) -> bool:
    """This process gets SIGKILL when its parent ends; if the parent is not ``expected_parent``
    (it ended already) it ends now.  False where the kernel has no parent-death signal."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # not Linux
        return False
    if os.getppid() != expected_parent:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def end_with_stdin(sig: signal.Signals = signal.SIGTERM) -> threading.Thread:
    """Send ``sig`` to this process when its standard input ends: a node's agent started by ssh
    stops its workers (its SIGTERM handler) when the launcher's ssh session to it closes."""
    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), sig)

    thread = threading.Thread(target=watch, name="deepshard-stdin-watch", daemon=True)
    thread.start()
    return thread
