"""fp16 with dynamic loss scaling at world size 2: an overflow injected on one rank skips the
step on every rank and halves the scale; the scale grows back after loss_scale_window clean steps."""

from __future__ import annotations

import math

from tests.core.zero_harness import distributed_run, engine_config

INJECT_AT = 2
KNOBS = {"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}


def _worker():
    import torch

    from deepshard.core import init_distributed

    init_distributed()
    out = {}
    for stage in (2, 3):
        cfg = engine_config(stage, dtype="fp16", precision=dict(KNOBS))
        losses, params, stats, _ = distributed_run(cfg, 7, inject_overflow_at=INJECT_AT)
        out[stage] = (losses, [(s.applied, s.loss_scale) for s in stats])
        # the skipped step changed nothing: replay without the injection, stopping before it
        _, p_before, _, _ = distributed_run(cfg, INJECT_AT)
        _, p_through, _, _ = distributed_run(cfg, INJECT_AT + 1, inject_overflow_at=INJECT_AT)
        out[(stage, "unchanged")] = all(torch.equal(p_before[n], p_through[n]) for n in p_before)
    return out


def test_overflow_skips_step_on_all_ranks_and_scale_recovers(gloo_pool):
    results = gloo_pool(2).run(_worker)
    for stage in (2, 3):
        for rank in (0, 1):
            losses, stats = results[rank][stage]
            applied = [a for a, _ in stats]
            scales = [s for _, s in stats]
            assert applied == [True, True, False, True, True, True, True], (stage, rank, stats)
            assert scales[INJECT_AT + 1] == scales[INJECT_AT] / 2  # dropped on the overflow
            assert max(scales[INJECT_AT + 1:]) > scales[INJECT_AT + 1]  # and grew back
            assert all(math.isfinite(v) for i, v in enumerate(losses) if i != INJECT_AT)
            assert losses[-1] < losses[0]
            assert results[rank][(stage, "unchanged")]
