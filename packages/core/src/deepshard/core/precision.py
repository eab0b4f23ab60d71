"""Compute dtypes and DeepSpeed's dynamic loss scaling for fp16."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepshard.core.config_error import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionConfig:
    """``dtype`` is the compute dtype; the loss-scale knobs are DeepSpeed's (used for fp16 only)."""

    dtype: str = "fp32"
    loss_scale: float = 0.0  # > 0: a static scale; 0: dynamic
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    consecutive_hysteresis: bool = False  # refill the hysteresis on every clean step, not only on growth
    raise_error_at_min_scale: bool = True  # an overflow at the minimum scale ends the run (DeepSpeed's default)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", self.dtype, f"valid values are {sorted(DTYPES)}")
        for key in ("loss_scale_window", "hysteresis"):
            if getattr(self, key) < 1:
                raise ConfigError(key, getattr(self, key), "must be >= 1")
        if self.loss_scale < 0:
            raise ConfigError("loss_scale", self.loss_scale, "must be >= 0 (0 means dynamic)")
        if self.min_loss_scale <= 0:
            raise ConfigError("min_loss_scale", self.min_loss_scale, "must be > 0")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class LossScaleAtMinimum(RuntimeError):
    """fp16 overflowed again with the loss scale already at ``min_loss_scale``: training cannot continue."""


class LossScaler:
    """DeepSpeed's DynamicLossScaler (``deepspeed/runtime/fp16/loss_scaler.py``), step for step.

    On overflow: halve the scale once ``hysteresis`` overflows have been absorbed (an overflow at
    the minimum scale raises :class:`LossScaleAtMinimum` when ``raise_error_at_min_scale``).  On a
    clean step: double the scale when the clean steps since the last overflow, *excluding* the
    first, are a positive multiple of ``loss_scale_window``; the hysteresis refills then, or on
    every clean step with ``consecutive_hysteresis``.  With fp32/bf16, or a static scale, the scale
    never moves.  tests/core/test_loss_scaler_vs_deepspeed.py replays DeepSpeed's own trajectories.
    """

    def __init__(self, config: PrecisionConfig) -> None:
        self.dynamic = config.dtype == "fp16" and config.loss_scale == 0
        if config.dtype != "fp16":
            self.scale = 1.0
        elif config.loss_scale > 0:
            self.scale = float(config.loss_scale)
        else:
            self.scale = float(2 ** config.initial_scale_power)
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.min_scale = config.min_loss_scale
        self.consecutive_hysteresis = config.consecutive_hysteresis
        self.raise_error_at_min_scale = config.raise_error_at_min_scale
        self.cur_hysteresis = config.hysteresis
        self.iteration = 0
        self.last_overflow = -1
        self.num_overflows = 0  # skipped steps so far (logged by the app)

    def update(self, overflow: bool) -> None:
        """Record one step's outcome (the step was skipped when ``overflow``)."""
        if self.dynamic:
            if overflow:
                self._on_overflow()
            else:
                if self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                stable = self.iteration - self.last_overflow - 1
                if stable > 0 and stable % self.window == 0:
                    if not self.consecutive_hysteresis:
                        self.cur_hysteresis = self.hysteresis
                    self.scale *= 2.0
        if overflow:
            self.num_overflows += 1
        self.iteration += 1

    def _on_overflow(self) -> None:
        if self.hysteresis == 1 or self.cur_hysteresis == 1:
            if self.scale == self.min_scale and self.raise_error_at_min_scale:
                raise LossScaleAtMinimum(
                    f"fp16 overflow at step {self.iteration + 1} with the loss scale already at "
                    f"precision.min_loss_scale={self.min_scale:g}: the gradients are not finite at any scale "
                    f"(lower optim.lr, use precision=bf16, or set precision.raise_error_at_min_scale=false)")
            self.scale = max(self.scale / 2.0, self.min_scale)
        else:
            self.cur_hysteresis -= 1
        self.last_overflow = self.iteration

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "cur_hysteresis": self.cur_hysteresis, "iteration": self.iteration,
                "last_overflow": self.last_overflow, "num_overflows": self.num_overflows}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.iteration = int(state["iteration"])
        self.last_overflow = int(state["last_overflow"])
        self.num_overflows = int(state.get("num_overflows", 0))
