"""When a non-finite step is an error: the run's divergence policy, called once per step.

The optimizer (``ZeroOptimizer.step``) skips any step whose global gradient norm is not finite and
reports ``applied=False``.  That is right for fp16 with a dynamic loss scale, where an overflow
means "scale too high" and the scaler backs off; a few such skips are routine and are counted.
Without a dynamic scale (fp32, bf16, a static fp16 scale) a non-finite loss or gradient means the
run is diverging (or the data is bad): each skip is a warning, and ``train.max_bad_steps``
consecutive ones stop the run with ``TrainingDiverged``, before anything is saved over the newest
good checkpoint.  With a dynamic scale, an overflow at ``precision.min_loss_scale`` ends the run in
the scaler itself (``LossScaleAtMinimum``, DeepSpeed's ``raise_error_at_min_scale``); with that
switched off, a scale stuck at the minimum while every step overflows, for
``precision.loss_scale_window`` steps, is still an error here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

FAULT_ENV = "DEEPSHARD_TEST_FAULT"  # test-only: nan@K or error@K (see inject_test_fault)


class TrainingDiverged(RuntimeError):
    """Raised identically on every rank (its inputs are all-reduced); the run exits non-zero."""


class DivergenceGuard:
    """Counts bad steps; ``check`` raises ``TrainingDiverged`` when the policy says stop."""

    def __init__(self, *, max_bad_steps: int, dynamic: bool, min_scale: float, scale_window: int,
                 say: Callable[[str], None]) -> None:
        self.max_bad_steps = max_bad_steps
        self.dynamic = dynamic
        self.min_scale = min_scale
        self.scale_window = scale_window
        self.say = say
        self.streak = 0  # consecutive bad steps (no dynamic scale)
        self.at_min = 0  # consecutive overflows with the scale already at its minimum
        self.skipped = 0  # every step not applied, the whole run
        self.last_finite: tuple[int, float] | None = None  # (step, loss) of the newest good step

    @classmethod
    def for_run(cls, settings, scaler, *, say: Callable[[str], None]) -> DivergenceGuard:
        """The run's guard: ``train.max_bad_steps``, the loss scaler's mode and floor, its window."""
        return cls(max_bad_steps=settings.train.max_bad_steps, dynamic=scaler.dynamic, min_scale=scaler.min_scale,
                   scale_window=settings.engine.precision.loss_scale_window, say=say)

    @property
    def saving_allowed(self) -> bool:
        """No checkpoint while a streak of bad steps runs: it may be the diverged state."""
        return self.streak == 0

    def check(self, step: int, loss: float, *, applied: bool, loss_scale: float, newest_checkpoint: str) -> None:
        finite = math.isfinite(loss)
        bad = not applied or not finite
        if not bad:
            self.streak = self.at_min = 0
            self.last_finite = (step, loss)
            return
        if not applied:
            self.skipped += 1
        if self.dynamic and not applied:  # a NaN loss too: DeepSpeed judges it by the scale's floor alone
            self._overflow(step, loss_scale, newest_checkpoint)
            return
        what = "gradient norm" if finite else ("loss" if applied else "loss and gradient norm")
        self.streak += 1
        skipped = "skipped" if not applied else "applied, but its loss is not finite"
        self.say(f"warning: step {step}: non-finite {what} (loss {loss}); step {skipped} "
                 f"({self.streak} in a row, train.max_bad_steps={self.max_bad_steps})")
        if self.streak >= self.max_bad_steps:
            raise TrainingDiverged(
                f"training diverged at step {step}: {self.streak} consecutive steps with a non-finite loss or "
                f"gradient (train.max_bad_steps={self.max_bad_steps}); {self._last_good()}; newest good "
                f"checkpoint: {newest_checkpoint}; nothing was saved after it (try a lower optim.lr or check the data)")

    def _overflow(self, step: int, scale: float, newest_checkpoint: str) -> None:
        """fp16 with a dynamic scale: a skip is routine unless the scale can go no lower."""
        self.at_min = self.at_min + 1 if scale <= self.min_scale else 0
        self.say(f"step {step}: fp16 overflow at loss scale {scale:g}, step skipped ({self.skipped} skipped so far)")
        if self.at_min >= self.scale_window:
            raise TrainingDiverged(
                f"training diverged at step {step}: the fp16 loss scale is stuck at precision.min_loss_scale="
                f"{self.min_scale:g} and every step overflowed for {self.at_min} steps (precision.loss_scale_window="
                f"{self.scale_window}); {self._last_good()}; newest good checkpoint: {newest_checkpoint} "
                f"(try precision=bf16 or a lower optim.lr)")

    def _last_good(self) -> str:
        if self.last_finite is None:
            return "no step of this run had a finite loss"
        step, loss = self.last_finite
        return f"last finite loss {loss:.4f} at step {step}"


def inject_test_fault(model: torch.nn.Module | None, step: int) -> None:
    """Test-only, does nothing unless ``DEEPSHARD_TEST_FAULT`` is set.  ``nan@K``: from step K on the
    embedding's output is NaN, so a real NaN flows through the loss into every gradient; ``nan@K:N``:
    for the N steps K..K+N-1 only (a transient fault the run recovers from).
    ``error@K``: the last rank raises at step K (a worker error the launcher must report)."""
    kind, _, at = os.environ.get(FAULT_ENV, "").partition("@")
    first, _, count = at.partition(":")
    if not first:
        return
    if kind == "nan" and model is not None and count and step == int(first) + int(count):
        _NAN_HOOKS.pop(id(model)).remove()
    if step != int(first):
        return
    if kind == "nan" and model is not None:
        hook = model.get_submodule("embed_tokens").register_forward_hook(lambda mod, inp, out: out * float("nan"))
        _NAN_HOOKS[id(model)] = hook
    elif kind == "error" and dist.get_rank() == dist.get_world_size() - 1:
        raise RuntimeError(f"injected test fault at step {step} ({FAULT_ENV}={kind}@{at})")


_NAN_HOOKS: dict[int, torch.utils.hooks.RemovableHandle] = {}  # nan@K:N: removed after N steps
