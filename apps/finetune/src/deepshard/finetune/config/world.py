"""How many ranks a run has: torchrun's (or the deepshard launcher's), or the local workers the app
starts (``launcher.nproc_per_node``: every local GPU, or 2 on a CPU-only host)."""

from __future__ import annotations

import os

from deepshard.launch.hostfile import MAX_SLOTS


def resolve_nproc(value: str, cuda_devices: int) -> int:
    """``auto``: every local GPU, or 2 workers on a CPU-only host (so the default run really shards)."""
    if str(value) == "auto":
        return cuda_devices or 2
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"launcher.nproc_per_node={value!r}: valid values are 'auto' or a positive integer")
    if n > MAX_SLOTS:  # before that many workers (and their per-rank lists) are made
        raise ValueError(f"launcher.nproc_per_node={n}: at most {MAX_SLOTS} workers per node (the launcher's bound)")
    if 0 < cuda_devices < n:
        raise ValueError(f"launcher.nproc_per_node={n} > {cuda_devices} visible GPU(s): nccl needs one GPU per "
                         f"rank; use at most {cuda_devices} (or 'auto')")
    return n


def under_torchrun() -> bool:
    """torchrun (any node count) already started one process per rank and set the environment."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def host_world_size(nproc_per_node: str) -> int:
    """torchrun's WORLD_SIZE, or the number of local workers the app will start."""
    import torch

    if "WORLD_SIZE" in os.environ and under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    return resolve_nproc(nproc_per_node, torch.cuda.device_count())
