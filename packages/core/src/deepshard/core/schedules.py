"""DeepSpeed's LR schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR) as pure ``step -> lr`` maps.

``lr_at(k)`` is the rate used by the k-th applied update (0-based), which DeepSpeed calls
``last_batch_iteration``; skipped fp16 steps do not advance it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
            raise ValueError(f"scheduler.name={self.name!r}: valid schedules are {list(SCHEDULES)}")
        if self.warmup_type not in ("log", "linear"):
            raise ValueError(f"scheduler.warmup_type={self.warmup_type!r}: valid values are ['linear', 'log']")
        if self.warmup_num_steps < 0:
            raise ValueError(f"scheduler.warmup_num_steps={self.warmup_num_steps}: must be >= 0")
        if self.name in ("WarmupDecayLR", "WarmupCosineLR") and self.total_num_steps <= self.warmup_num_steps:
            raise ValueError(
                f"scheduler.total_num_steps={self.total_num_steps}: {self.name} needs total_num_steps > "
                f"warmup_num_steps ({self.warmup_num_steps})"
            )


class LRSchedule:
    """``lr_at(k)`` for a config; ``base_lr`` is the optimizer's lr (used by constant and cosine)."""

    def __init__(self, config: SchedulerConfig, base_lr: float) -> None:
        self.config = config
        self.base_lr = base_lr

    def _warmup_gamma(self, k: int) -> float:
        c = self.config
        if k >= c.warmup_num_steps:
            return 1.0
        if c.warmup_type == "log":
            return math.log(k + 1) / math.log(c.warmup_num_steps) if c.warmup_num_steps > 1 else 1.0
        return k / c.warmup_num_steps

    def lr_at(self, k: int) -> float:
        c = self.config
        if c.name == "constant":
            return self.base_lr
        if c.name == "WarmupCosineLR":
            if k < c.warmup_num_steps:
                ratio = c.warmup_min_ratio + (1 - c.warmup_min_ratio) * self._warmup_gamma(k)
            else:
                done = (k - c.warmup_num_steps) / (c.total_num_steps - c.warmup_num_steps)
                ratio = max(0.0, c.cos_min_ratio + (1 - c.cos_min_ratio) * (1 + math.cos(math.pi * min(done, 1.0))) / 2)
            return ratio * self.base_lr
        gamma = self._warmup_gamma(k)
        if c.name == "WarmupDecayLR" and k >= c.warmup_num_steps:
            gamma = max(0.0, (c.total_num_steps - k) / max(1.0, c.total_num_steps - c.warmup_num_steps))
        return c.warmup_min_lr + (c.warmup_max_lr - c.warmup_min_lr) * gamma
