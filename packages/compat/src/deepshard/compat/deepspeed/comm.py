"""``deepspeed.comm``'s everyday calls on torch.distributed (the default process group)."""

from __future__ import annotations

import atexit

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


def close_group_at_exit() -> None:
    """Destroy the default group when the interpreter exits, while Python is still whole.  DeepSpeed
    scripts and transformers' Trainer rarely call ``destroy_process_group``; gloo's worker threads then
    hold finished work whose tensors reference Python objects, and their teardown during interpreter
    finalization can abort the process (SIGABRT, "terminate called without an active exception":
    pytorch#179291, seen once here on a Trainer script's rank 1 after training had ended).  Registered
    once; a group the script destroyed itself is left alone."""
    if not _closing:
        _closing.append(True)
        atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
