"""deepshard.launch: starting and watching training processes.

``launch_local`` starts local workers over torch's elastic agent and turns their failures into one
line (``JobFailed``); ``Heartbeat`` and ``Watchdog`` name a hung rank; ``run_lock`` keeps a second
job out of a run's directories.  It uses core's small process helpers and never imports the app.
The names load with their module on first use (``deepshard.core.lazy``): ``worker_server`` must be
importable without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepshard.core.lazy import lazy_names

_HOMES = {"Heartbeat": "heartbeat", "Watchdog": "heartbeat", "JobFailed": "local", "launch_local": "local",
          "start_worker_server": "local", "worker_threads": "local", "DirectoryInUse": "run_lock"}
__all__ = ["DirectoryInUse", "Heartbeat", "JobFailed", "Watchdog", "launch_local", "start_worker_server",
           "worker_threads"]

if TYPE_CHECKING:
    from deepshard.launch.heartbeat import Heartbeat, Watchdog
    from deepshard.launch.local import JobFailed, launch_local, start_worker_server, worker_threads
    from deepshard.launch.run_lock import DirectoryInUse

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
