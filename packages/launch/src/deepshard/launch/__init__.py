"""deepshard.launch: starting and watching training processes.

``launch_local`` starts local workers over torch's elastic agent and turns their failures into one
line (``JobFailed``); ``Heartbeat`` and ``Watchdog`` name a hung rank; ``run_lock`` keeps a second
job out of a run's directories.  It uses core's small process helpers and never imports the app.
"""

from deepshard.launch.heartbeat import Heartbeat, Watchdog
from deepshard.launch.local import JobFailed, launch_local, start_worker_server, worker_threads
from deepshard.launch.run_lock import DirectoryInUse

__all__ = ["DirectoryInUse", "Heartbeat", "JobFailed", "Watchdog", "launch_local", "start_worker_server",
           "worker_threads"]
