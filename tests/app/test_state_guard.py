"""The divergence guard on plain inputs: the state an update leaves (its parameter norm) decides
whether a step is good, and a run never ends on a bad state; checkpoint.resume's values."""

from __future__ import annotations

import pytest

from deepshard.finetune.config.settings import validate_checkpoint
from deepshard.finetune.recipe.divergence import DivergenceGuard, TrainingDiverged

NAN = float("nan")


def _guard(said: list[str], *, dynamic: bool = False, growth: float = 10.0) -> DivergenceGuard:
    return DivergenceGuard(max_bad_steps=3, dynamic=dynamic, min_scale=1.0, scale_window=4, say=said.append,
                           max_param_growth=growth)


def test_an_update_that_blows_the_weights_up_is_a_bad_step_until_the_state_is_back():
    said: list[str] = []
    g = _guard(said)
    g.reference(20.0)  # the run's starting state
    g.check(1, 7.6, applied=True, loss_scale=1.0, param_norm=20.5, newest_checkpoint="none")
    assert g.saving_allowed and not said
    g.check(2, 7.6, applied=True, loss_scale=1.0, param_norm=3e9, newest_checkpoint="ck1")  # finite loss
    assert not g.saving_allowed
    assert said[-1].startswith("warning: step 2: the update blew the parameters up (norm 3e+09, ")
    assert "train.max_param_growth=10" in said[-1]
    # the next update is small next to the blown-up state, but the state is still far from the good one
    g.check(3, 7.5, applied=True, loss_scale=1.0, param_norm=3.1e9, newest_checkpoint="ck1")
    assert not g.saving_allowed
    with pytest.raises(TrainingDiverged) as err:
        g.check(4, 7.5, applied=False, loss_scale=1.0, param_norm=None, newest_checkpoint="ck1")
    msg = str(err.value)
    assert msg.startswith("training diverged at step 4: 3 consecutive steps") and "\n" not in msg
    assert "last finite loss 7.6000 at step 1" in msg and "newest good checkpoint: ck1;" in msg


def test_non_finite_parameters_are_bad_whatever_the_loss_and_a_recovery_resets():
    said: list[str] = []
    g = _guard(said)
    g.reference(20.0)
    g.check(1, 7.6, applied=True, loss_scale=1.0, param_norm=NAN, newest_checkpoint="none")
    assert not g.saving_allowed and "the update made the parameters not finite (norm nan)" in said[-1]
    g.check(2, 7.6, applied=True, loss_scale=1.0, param_norm=25.0, newest_checkpoint="none")  # within 10x of 20
    assert g.saving_allowed


def test_growth_zero_checks_finiteness_only_and_fp16_updates_are_judged_too():
    said: list[str] = []
    g = _guard(said, growth=0.0)
    g.reference(1.0)
    g.check(1, 7.6, applied=True, loss_scale=1.0, param_norm=1e12, newest_checkpoint="none")
    assert g.saving_allowed
    d = _guard(said, dynamic=True)
    d.reference(1.0)
    d.check(1, 7.6, applied=True, loss_scale=1024.0, param_norm=1e6, newest_checkpoint="none")
    assert not d.saving_allowed
    d.check(2, 7.6, applied=False, loss_scale=512.0, param_norm=None, newest_checkpoint="none")  # overflow
    assert not d.saving_allowed  # a skip leaves the blown-up state as it was


@pytest.mark.parametrize("bad", [dict(applied=False, param_norm=None), dict(applied=True, param_norm=1e9)])
def test_the_last_step_of_a_run_on_a_bad_state_raises_even_below_max_bad_steps(bad):
    said: list[str] = []
    g = _guard(said)
    g.reference(1.0)
    g.check(1, 7.6, applied=True, loss_scale=1.0, param_norm=1.0, newest_checkpoint="none")
    with pytest.raises(TrainingDiverged, match=r"^training diverged at step 2: the run ended on 1 bad step\(s\) in a "
                                               r"row .*; last finite loss 7.6000 at step 1; newest good checkpoint: none; its final "
                                               r"state was not saved"):
        g.check(2, NAN if not bad["applied"] else 7.0, loss_scale=1.0, newest_checkpoint="none", last=True, **bad)


def test_the_last_step_on_a_good_state_ends_normally_and_fp16_overflow_at_the_end_is_routine():
    g = _guard([], dynamic=True)
    g.reference(1.0)
    g.check(1, 7.6, applied=False, loss_scale=1024.0, param_norm=None, newest_checkpoint="none", last=True)
    assert g.saving_allowed


def test_checkpoint_resume_accepts_auto_or_fresh_and_names_the_valid_values():
    assert validate_checkpoint({"resume": "auto_or_fresh"}).resume == "auto_or_fresh"
    with pytest.raises(ValueError, match=r"checkpoint\.resume='fresh': valid values are 'auto', 'auto_or_fresh', "
                                         r"'none' or an existing checkpoint directory"):
        validate_checkpoint({"resume": "fresh"})
