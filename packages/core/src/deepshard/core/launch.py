"""Start local worker processes with torch's elastic launcher (used by the app and the tests).

A worker that raises ends the whole job with its error (ChildFailedError), never a hang.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from deepshard.core.mesh import free_port


def worker_threads(nproc: int, *, cuda: bool, cpus: int | None = None) -> int:
    """OpenMP threads per local worker.  With GPUs each rank gets its share of the cores this
    process may use (``sched_getaffinity``): the host AdamW of CPU/NVMe offload, the host-side
    casts and the data pipeline run there, and one thread starves them.  On a CPU-only host 1: the
    ranks' compute already contends for the same cores (torch-cpu-facts), and a fixed count keeps
    CPU results independent of the host's core count."""
    if not cuda:
        return 1
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, nproc))


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any, threads_per_worker: int | None = None,
                 run_id: str | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks (gloo/nccl group set up by the worker via
    ``init_distributed``); returns each rank's return value, rank-ordered.  ``run_id`` reaches the
    workers as ``TORCHELASTIC_RUN_ID`` (it names per-run scratch such as NVMe swap dirs).
    ``threads_per_worker`` (OMP_NUM_THREADS of each worker) defaults to :func:`worker_threads`."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if threads_per_worker is None:  # auto: see worker_threads
        import torch

        threads_per_worker = worker_threads(nproc, cuda=torch.cuda.is_available())
    os.environ["OMP_NUM_THREADS"] = str(threads_per_worker)  # inherited by the workers
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id or uuid.uuid4().hex[:8],
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.1, start_method="spawn",
    )
    results = elastic_launch(config, fn)(*args)
    return [results[r] for r in range(nproc)]
