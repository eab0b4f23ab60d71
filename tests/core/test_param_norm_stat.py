"""StepStats.param_norm, the global norm of the parameters an applied step leaves, at world 2 for
every ZeRO stage, against plain torch.optim.AdamW's parameters after the same steps."""

from __future__ import annotations

import math

import pytest
import torch

from tests.core.zero_harness import distributed_run, engine_config, reference

STEPS = 3
STAGES = (0, 1, 2, 3)


def _worker():
    from deepshard.core import init_distributed

    init_distributed()
    out = {}
    for stage in STAGES:
        _, _, stats, _ = distributed_run(engine_config(stage), STEPS)
        out[stage] = [(s.applied, s.param_norm) for s in stats]
    # an overflowing step (fp16, dynamic scale) changes nothing and measures nothing
    _, _, stats, _ = distributed_run(engine_config(2, dtype="fp16"), 2, inject_overflow_at=1)
    out["overflow"] = [(s.applied, s.param_norm) for s in stats]
    return out


@pytest.fixture(scope="module")
def runs(gloo_pool):
    return gloo_pool(2).run(_worker)[0]


@pytest.mark.slow
def test_param_norm_is_the_norm_of_the_updated_parameters(runs):
    _, params = reference(STEPS, 2, 1, engine_config(0).optim)
    ref = torch.cat([p.flatten() for p in params.values()]).norm().item()
    for stage in STAGES:
        assert all(applied and math.isfinite(norm) for applied, norm in runs[stage])
        assert runs[stage][-1][1] == pytest.approx(ref, rel=1e-5), (stage, runs[stage], ref)
    (first_applied, first_norm), (second_applied, second_norm) = runs["overflow"]
    assert first_applied and math.isfinite(first_norm)
    assert not second_applied and second_norm is None
