"""Our LossScaler replays DeepSpeed 0.19.8's own DynamicLossScaler, step for step.

The fixture was recorded from real DeepSpeed by bench/record_ds_loss_scaler.py (40 random overflow
sequences of 120 steps: windows 1/3/10, hysteresis 1/2/3, consecutive_hysteresis on/off, and runs
that reach the minimum scale with raise_error_at_min_scale on/off).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepshard.core.precision import LossScaleAtMinimum, LossScaler, PrecisionConfig

CASES = json.loads((Path(__file__).parent / "fixtures" / "ds_loss_scaler.json").read_text())["cases"]


def _name(case: dict) -> str:
    k = case["knobs"]
    return (f"w{k['loss_scale_window']}-h{k['hysteresis']}-ch{int(k['consecutive_hysteresis'])}"
            f"-min{k['min_loss_scale']:g}-raise{int(k['raise_error_at_min_scale'])}")


def test_fixture_covers_the_knobs():
    knobs = [c["knobs"] for c in CASES]
    assert {k["loss_scale_window"] for k in knobs} == {1, 3, 10}
    assert {k["hysteresis"] for k in knobs} >= {1, 2, 3}
    assert {k["consecutive_hysteresis"] for k in knobs} == {False, True}
    assert any(c["raised_at"] is not None for c in CASES)  # some runs end at the minimum scale
    assert any(not c["knobs"]["raise_error_at_min_scale"] and min(s for s, _ in c["after"]) == 2.0 for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{_name(c)}" for i, c in enumerate(CASES)])
def test_scale_and_hysteresis_match_deepspeed_after_every_step(case):
    scaler = LossScaler(PrecisionConfig(dtype="fp16", **case["knobs"]))
    ours = []
    raised_at = None
    for i, overflow in enumerate(case["overflows"]):
        try:
            scaler.update(overflow)
        except LossScaleAtMinimum:
            raised_at = i
            break
        ours.append([scaler.scale, scaler.cur_hysteresis])
    assert raised_at == case["raised_at"]
    assert ours == case["after"]
