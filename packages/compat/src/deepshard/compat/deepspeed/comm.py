"""``deepspeed.comm``'s everyday calls on torch.distributed (the default process group)."""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist

from deepshard.core.mesh import init_distributed as _join


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    import os

    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group: dist.ProcessGroup | None = None) -> None:
    if dist.is_initialized():
        dist.barrier(group)


def init_distributed(dist_backend: str | None = None, **_: object) -> None:
    """Join (or start) the default group: gloo on CPU, nccl on CUDA (``dist_backend`` must agree)."""
    from deepshard.core.mesh import device_type

    expected = "nccl" if device_type() == "cuda" else "gloo"
    if dist_backend not in (None, expected):
        raise ValueError(f"init_distributed(dist_backend={dist_backend!r}): this host uses {expected!r}")
    _join()


_closing: list[bool] = []
# how long the exit handler leaves the GIL free for gloo's worker threads (their release takes microseconds
# once they run; this covers a busy host's scheduling delay)
RELEASE_S = 0.1


def close_group_at_exit() -> None:
    """At interpreter exit, destroy the default group and let gloo's worker threads drop their finished
    work while Python is still whole.  A gloo worker frees a finished collective's tensors itself, and a
    tensor made in Python needs the GIL to die: when a script's last collective returns just before it
    exits (transformers' Trainer ends ``train()`` with an ``all_gather`` of its FLOP count), the worker
    can still be freeing those tensors when the interpreter finalizes, and the thread is killed inside
    C++: SIGABRT, "terminate called without an active exception" (seen in .ci/run on a Trainer script's
    rank 1; a core dump showed ``~AsyncAllgatherWork`` -> ``decref_pyobject`` -> ``take_gil`` ->
    ``pthread_exit``).  Destroying the group is not enough: the engine's mesh and FSDP state keep the
    C++ group, and its workers, alive.  So the handler also sleeps ``RELEASE_S`` with the GIL released.
    Registered once; a group the script destroyed itself is left alone."""
    if not _closing:
        _closing.append(True)
        atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(RELEASE_S)  # the GIL is free: a gloo worker finishing a collective's release takes it now
