"""When a bad step is an error: the run's divergence policy, called once per step.

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

The loss of a step is measured before its update, so a finite loss says nothing of the state the
update leaves: an applied step is also bad when the parameters it leaves are not finite, or when
their global norm (``StepStats.param_norm``) exceeds ``train.max_param_growth`` times the norm of
the newest good state (the run's start, or the last good step).  AdamW moves each weight by about
``lr`` a step: on the default run (``optim.lr=3e-3``) the norm grows by at most 0.7% a step, at ten
times that lr by 12%; ``optim.lr=1e9`` multiplies it by 1e10.  Such a state stays bad until a step
brings it back within the bound: nothing is saved meanwhile.  With ``offload.params=nvme`` each update
is applied in the next forward, where the norm is taken (``StepStats.param_norm_step``): a step judges the
state the previous update left and names that update; a step that saves first applies its own update
and judges it, so no blown state is saved.
A run whose last step is bad ends with ``TrainingDiverged`` too, however few bad steps it had: a run
never ends "done" on a non-finite or blown-up state.
"""

from __future__ import annotations

import math
from collections.abc import Callable


class TrainingDiverged(RuntimeError):
    """Raised identically on every rank (its inputs are all-reduced); the run exits non-zero."""


class DivergenceGuard:
    """Counts bad steps; ``check`` raises ``TrainingDiverged`` when the policy says stop."""

    def __init__(self, *, max_bad_steps: int, dynamic: bool, min_scale: float, scale_window: int,
                 say: Callable[[str], None], max_param_growth: float = 0.0) -> None:
        self.max_bad_steps = max_bad_steps
        self.dynamic = dynamic
        self.min_scale = min_scale
        self.scale_window = scale_window
        self.say = say
        self.max_param_growth = max_param_growth  # 0: only non-finite parameters are a bad state
        self.streak = 0  # consecutive bad steps (a dynamic scale's overflow skips aside)
        self.at_min = 0  # consecutive overflows with the scale already at its minimum
        self.skipped = 0  # every step not applied, the whole run
        self.last_finite: tuple[int, float] | None = None  # (step, loss) of the newest good step
        self.good_norm: float | None = None  # the parameter norm of the newest good state

    def reference(self, param_norm: float | None) -> None:
        """The parameter norm of the state the run starts from (its init, or the checkpoint resumed)."""
        self.good_norm = param_norm if param_norm is not None and math.isfinite(param_norm) else None

    @property
    def saving_allowed(self) -> bool:
        """No checkpoint while a streak of bad steps runs: it may be the diverged state."""
        return self.streak == 0

    def check(self, step: int, loss: float, *, applied: bool, loss_scale: float, newest_checkpoint: str,
              param_norm: float | None = None, param_norm_step: int | None = None, last: bool = False) -> None:
        """Judge ``step``: its loss (before the update), whether it was applied, and the parameter norm
        it left (``param_norm_step``: of an earlier step's update, deferred); ``last``: the run's final
        step, which must leave a good state."""
        blown = self._blown(applied or param_norm_step is not None, param_norm)  # an earlier update's: it was applied
        if blown is not None and param_norm_step is not None:  # the loss then comes from that state already
            blown = blown.replace("the update ", f"the update of step {param_norm_step} ", 1)
        finite = math.isfinite(loss)
        if applied and finite and blown is None:
            self.streak = self.at_min = 0
            self.last_finite = (step, loss)
            self.good_norm = param_norm if param_norm is not None else self.good_norm
            return
        if not applied:
            self.skipped += 1
        if self.dynamic and not applied:  # a NaN loss too: DeepSpeed judges it by the scale's floor alone
            self._overflow(step, loss_scale, newest_checkpoint)
        else:
            self._bad(step, loss, applied=applied, blown=blown, newest_checkpoint=newest_checkpoint,
                      lagged=param_norm_step is not None)
        if last and self.streak:
            raise TrainingDiverged(
                f"training diverged at step {step}: the run ended on {self.streak} bad step(s) in a row (fewer than "
                f"train.max_bad_steps={self.max_bad_steps}, but none good after them); {self._last_good()}; newest "
                f"good checkpoint: {newest_checkpoint}; its final state was not saved (try a lower optim.lr or "
                f"check the data)")

    def _blown(self, applied: bool, param_norm: float | None) -> str | None:
        """What is wrong with the parameters an applied step left, or None (also: not measured)."""
        if not applied or param_norm is None:
            return None
        if not math.isfinite(param_norm):
            return f"the update made the parameters not finite (norm {param_norm})"
        ref, bound = self.good_norm, self.max_param_growth
        if bound and ref and param_norm > bound * ref:
            return (f"the update blew the parameters up (norm {param_norm:.3g}, {param_norm / ref:.3g} x the newest "
                    f"good state's {ref:.4g}; train.max_param_growth={bound:g})")
        return None

    def _bad(self, step: int, loss: float, *, applied: bool, blown: str | None, newest_checkpoint: str,
             lagged: bool = False) -> None:
        """A bad step without a dynamic scale (or an applied one with it): a warning, and an error at
        ``train.max_bad_steps`` in a row."""
        self.streak += 1
        count = f"({self.streak} in a row, train.max_bad_steps={self.max_bad_steps})"
        if blown is not None and (math.isfinite(loss) or lagged):
            self.say(f"warning: step {step}: {blown}; nothing saved until a step is good {count}")
        else:
            finite = math.isfinite(loss)
            what = "gradient norm" if finite else ("loss" if applied else "loss and gradient norm")
            skipped = "skipped" if not applied else "applied, but its loss is not finite"
            self.say(f"warning: step {step}: non-finite {what} (loss {loss}); step {skipped} {count}")
        if self.streak >= self.max_bad_steps:
            raise TrainingDiverged(
                f"training diverged at step {step}: {self.streak} consecutive steps with a non-finite loss or "
                f"gradient, or parameters not finite or blown up (train.max_bad_steps={self.max_bad_steps}); "
                f"{self._last_good()}; newest good checkpoint: {newest_checkpoint}; nothing was saved after it "
                f"(try a lower optim.lr or check the data)")

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
            return "no step of this run was good"
        step, loss = self.last_finite
        return f"last finite loss {loss:.4f} at step {step}"
