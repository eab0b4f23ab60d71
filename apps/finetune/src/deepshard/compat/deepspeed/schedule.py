"""DeepSpeed applies its LR scheduler one update late: the k-th update (0-based) uses the rate the
scheduler computed at ``last_batch_iteration = k - 1``, and the first one the scheduler's value
before it started (``warmup_min_lr`` for WarmupLR/WarmupDecayLR, 0 for WarmupCosineLR).  Core's
``LRSchedule.lr_at(k)`` is the rate at iteration ``k``; this adapter gives DeepSpeed's sequence, so
a run switched from DeepSpeed trains with the same rates (measured against DeepSpeed 0.19.8).
"""

from __future__ import annotations

from collections.abc import Callable

from deepshard.core import SchedulerConfig


def before_start(config: SchedulerConfig) -> float:
    """The rate DeepSpeed's scheduler sets before its first step()."""
    return 0.0 if config.name == "WarmupCosineLR" else config.warmup_min_lr


def deepspeed_lr_at(lr_at: Callable[[int], float], config: SchedulerConfig) -> Callable[[int], float]:
    """``k -> rate of the k-th update`` as DeepSpeed's engine applies it (constant: unchanged)."""
    if config.name == "constant":
        return lr_at
    first = before_start(config)

    def lr(k: int) -> float:
        return first if k == 0 else lr_at(k - 1)

    return lr
