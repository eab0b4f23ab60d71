"""Imported first by ``launch_local``'s forkserver as it starts: the server dies with its launcher.

The server's workers die with the server (``parent_death.die_with_parent``), but the server itself
would outlive a SIGKILLed launcher: its workers hold the launcher's end of the pipe whose closing
tells the server to exit.  The launcher names itself in ``SERVER_PARENT_ENV`` only while it starts
the server, so only the server finds it.

The server ignores SIGTERM: a preemption's SIGTERM to the job's process group must reach the
workers (they save a final checkpoint on it), not end their parent, whose end would kill them
mid-save.  The workers take SIGTERM's default back as they start (``local._in_launch_env``).
"""

import os
import signal

from deepshard.launch.parent_death import SERVER_PARENT_ENV, die_with_parent

_parent = os.environ.pop(SERVER_PARENT_ENV, None)
if _parent:
    die_with_parent(int(_parent))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
