"""deepshard.launch: starting and watching training processes.

``launch_local`` starts local workers over torch's elastic agent and turns their failures into one
line (``JobFailed``); ``Heartbeat`` and ``Watchdog`` name a hung rank; ``run_lock`` keeps a second
job out of a run's directories.  It uses core's small process helpers and never imports the app.
"""

from deepshard.core.lazy_exports import lazy_exports

# imported on first use: the `deepshard` command's modules (deepshard.launch.cli and what it imports)
# load without torch, which only a node's agent needs
__getattr__, __dir__ = lazy_exports(__name__, {
    "deepshard.launch.heartbeat": ("Heartbeat", "Watchdog"),
    "deepshard.launch.local": ("JobFailed", "launch_local", "start_worker_server", "worker_threads"),
    "deepshard.launch.run_lock": ("DirectoryInUse",),
})

__all__ = ["DirectoryInUse", "Heartbeat", "JobFailed", "Watchdog", "launch_local", "start_worker_server",
           "worker_threads"]
