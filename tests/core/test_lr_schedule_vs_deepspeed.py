"""Core's LR schedules give each update the rate real DeepSpeed 0.19.8's engine gives it.

The fixture was recorded from DeepSpeed's own engine by bench/record_ds_lr_schedules.py (world 1,
``engine.get_lr()`` before each ``engine.step()``): WarmupLR, WarmupDecayLR and WarmupCosineLR,
linear and log warm-ups, a one-step warm-up (DeepSpeed lasts it two), 20 updates reaching past
``total_num_steps``, and a save mid-warm-up resumed in a fresh engine.  CI needs no DeepSpeed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepshard.core.schedules import LRSchedule, SchedulerConfig

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "ds_lr_schedules.json").read_text())
CASES = FIXTURE["cases"]


def _schedule(case: dict) -> LRSchedule:
    return LRSchedule(SchedulerConfig(name=case["name"], **case["params"]), case["base_lr"])


def test_fixture_covers_every_schedule():
    assert {c["name"] for c in CASES} == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"}
    assert {c["params"]["warmup_type"] for c in CASES} == {"linear", "log"}
    assert any(c["params"]["warmup_num_steps"] == 1 for c in CASES)
    assert all(len(c["lrs"]) > c["params"].get("total_num_steps", 0) for c in CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"{i}-{c['name']}-{c['params']['warmup_type']}-w"
                                             f"{c['params']['warmup_num_steps']}" for i, c in enumerate(CASES)])
def test_rate_of_every_update_matches_deepspeed(case):
    schedule = _schedule(case)
    ours = [schedule.lr_at(k) for k in range(len(case["lrs"]))]
    assert ours == pytest.approx(case["lrs"], rel=1e-12, abs=1e-15)


def test_resume_continues_deepspeeds_rates():
    """Our checkpoint's schedule state is the update count; DeepSpeed's is last_batch_iteration = count - 1."""
    r = FIXTURE["resume"]
    schedule = _schedule(CASES[r["case"]])
    saved_updates = r["save_after"]
    assert r["scheduler_state_loaded"]["last_batch_iteration"] == saved_updates - 1
    assert [schedule.lr_at(k) for k in range(saved_updates)] == pytest.approx(r["lrs_before"], abs=1e-15)
    after = [schedule.lr_at(saved_updates + k) for k in range(r["updates_after"])]
    assert after == pytest.approx(r["lrs_after"], rel=1e-12)
