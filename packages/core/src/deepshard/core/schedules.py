"""DeepSpeed's LR schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR) as pure ``update -> lr`` maps.

``lr_at(k)`` is the rate the k-th applied update (0-based) uses, equal to the rate DeepSpeed 0.19's
engine gives its k-th update (checked against recorded DeepSpeed runs: tests/core/fixtures/
ds_lr_schedules.json).  Skipped fp16 steps advance neither.  The schedule is a pure function of the
update count, so a checkpoint's ``num_updates`` is its whole state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepshard.core.config_error import ConfigError

SCHEDULES = ("constant", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


@dataclass(frozen=True)
class SchedulerConfig:
    name: str = "constant"
    warmup_min_lr: float = 0.0
    warmup_max_lr: float = 1e-3  # WarmupLR / WarmupDecayLR peak
    warmup_num_steps: int = 0
    warmup_type: str = "linear"  # log | linear
    total_num_steps: int = 0  # WarmupDecayLR / WarmupCosineLR
    warmup_min_ratio: float = 0.0  # WarmupCosineLR
    cos_min_ratio: float = 1e-4  # WarmupCosineLR

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ConfigError("name", self.name, f"valid schedules are {list(SCHEDULES)}")
        if self.warmup_type not in ("log", "linear"):
            raise ConfigError("warmup_type", self.warmup_type, "valid values are ['linear', 'log']")
        if self.warmup_num_steps < 0:
            raise ConfigError("warmup_num_steps", self.warmup_num_steps, "must be >= 0")
        if self.name in ("WarmupDecayLR", "WarmupCosineLR") and self.total_num_steps <= self.warmup_num_steps:
            raise ConfigError("total_num_steps", self.total_num_steps,
                              f"{self.name} needs total_num_steps > warmup_num_steps ({self.warmup_num_steps})")


class LRSchedule:
    """``lr_at(k)``: the rate of the k-th applied update (0-based), as DeepSpeed's engine applies it.

    DeepSpeed sets the rate of iteration -1 ("before it has started": ``warmup_min_lr``, or ratio 0
    for WarmupCosineLR) when the scheduler is built and steps the scheduler *after* each applied
    update, so update k runs at ``rate(k - 1)``: one update late against the formulas read plainly.
    ``base_lr`` is the optimizer's lr (used by constant and cosine).  As in DeepSpeed, a warm-up of
    one step lasts two (``max(2, warmup_num_steps)``); ``warmup_num_steps=0`` (which DeepSpeed
    refuses) means no warm-up: every update runs at the post-warm-up rate of ``max(k - 1, 0)``.
    """

    def __init__(self, config: SchedulerConfig, base_lr: float) -> None:
        self.config = config
        self.base_lr = base_lr
        self.warmup = max(2, config.warmup_num_steps) if config.warmup_num_steps > 0 else 0

    def _warmup_gamma(self, it: int) -> float:
        if self.config.warmup_type == "log":
            return math.log(it + 1) / math.log(self.warmup)
        return it / self.warmup

    def rate(self, it: int) -> float:
        """DeepSpeed's ``get_lr()`` at ``last_batch_iteration = it`` (``it = -1``: before its first step)."""
        c = self.config
        if c.name == "constant":
            return self.base_lr
        if it < 0:
            if self.warmup:
                return 0.0 if c.name == "WarmupCosineLR" else c.warmup_min_lr
            it = 0
        w = self.warmup
        if c.name == "WarmupCosineLR":
            if it < w:
                ratio = c.warmup_min_ratio + (1 - c.warmup_min_ratio) * self._warmup_gamma(it)
            else:
                done = min(1.0, (it - w + 1) / max(1, c.total_num_steps - w))
                ratio = max(0.0, c.cos_min_ratio + (1 - c.cos_min_ratio) * (1 + math.cos(math.pi * done)) / 2)
            return ratio * self.base_lr
        if it < w:
            gamma = self._warmup_gamma(it)
        elif c.name == "WarmupDecayLR":
            gamma = max(0.0, (c.total_num_steps - it) / max(1.0, c.total_num_steps - w))
        else:
            gamma = 1.0
        return c.warmup_min_lr + (c.warmup_max_lr - c.warmup_min_lr) * gamma

    def lr_at(self, k: int) -> float:
        """The rate of the k-th applied update (skipped fp16 steps do not count)."""
        return self.rate(k - 1)
