"""fp16 through the app for real on a CPU-only host (``precision.force_fp16_on_cpu=true``): DeepSpeed's
default loss scale (2^16) trains without overflowing at the start, a too-high scale is halved on
skipped steps, and the scale trajectory and the skips are logged."""

from __future__ import annotations

import pytest

from tests.finetune_app.app_harness import TINY, prompt_response_rows, run_app, scalars, write_jsonl

pytestmark = pytest.mark.slow


def test_fp16_app_run_logs_scale_trajectory_and_skipped_steps(tmp_path):
    data = write_jsonl(tmp_path / "pr.jsonl", prompt_response_rows(200))
    proc = run_app(tmp_path, "data=jsonl", f"data.path={data}", "data.pack=false", "precision=fp16",
                   "precision.force_fp16_on_cpu=true", "precision.initial_scale_power=20",
                   "precision.loss_scale_window=4", "precision.hysteresis=1", "+zero=stage2",
                   "train.max_steps=20", "train.micro_batch_size=2", "train.grad_accum=2", "launcher.nproc_per_node=1",
                   *TINY)  # one rank: skipping on every rank is tests/core/test_fp16_loss_scaling.py's
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "real fp16" in out and "fp16, " in out  # trained in fp16, not the fp32 fallback
    logged = scalars(tmp_path / "run/tensorboard")
    scale, applied, loss = logged["train/loss_scale"], logged["train/step_applied"], logged["train/loss"]
    assert len(scale) == len(applied) == 20
    skipped = [i for i, a in enumerate(applied) if a == 0]
    assert skipped, f"2^20 must overflow at first: {scale}"
    for i in skipped:  # each skip (hysteresis 1) halves the scale for the next step
        if i + 1 < len(scale):
            assert scale[i + 1] == scale[i] / 2, (i, scale)
    grown = [i for i in range(1, len(scale)) if scale[i] > scale[i - 1]]
    assert grown, f"after loss_scale_window=4 good steps the scale must grow: {scale}"
    for i in grown:  # growth: doubled, and only after a window of 4 applied steps
        assert scale[i] == 2 * scale[i - 1] and all(applied[i - 4:i]), (i, scale, applied)
    assert applied.count(1.0) >= len(applied) // 2, (scale, applied)  # then it trains
    assert scale[0] == 2.0**20 and min(scale) < 2.0**20
    finite = [v for v, a in zip(loss, applied) if a]
    assert finite[-1] < finite[0]


def test_fp16_default_scale_does_not_overflow_at_the_start(tmp_path):
    data = write_jsonl(tmp_path / "pr.jsonl", prompt_response_rows(200))
    proc = run_app(tmp_path, "data=jsonl", f"data.path={data}", "data.pack=false", "precision=fp16",
                   "precision.force_fp16_on_cpu=true", "train.max_steps=6", "train.micro_batch_size=2",
                   "train.grad_accum=2", "launcher.nproc_per_node=1", *TINY)  # the scale is per run: one rank
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    logged = scalars(tmp_path / "run/tensorboard")
    assert logged["train/loss_scale"] == [2.0**16] * 6  # DeepSpeed's default initial_scale_power
    assert logged["train/step_applied"] == [1.0] * 6
