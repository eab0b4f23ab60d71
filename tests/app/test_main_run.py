"""The README's run command, shortened: 2 workers, ZeRO-3, learns, writes TensorBoard scalars."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.app_runner import run_main

pytestmark = pytest.mark.slow  # world-size launches: the full suite only (the inner loop: -m 'not slow')

ROOT = Path(__file__).resolve().parents[2]


def test_readme_run_command_trains_and_logs(tmp_path):
    proc = run_main(["+zero=stage3", "train.max_steps=10", "train.log_every=1", f"hydra.run.dir={tmp_path}"],
                    cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 rank(s), zero stage 3" in proc.stdout + proc.stderr
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/loss_scale", "train/tokens_per_s",
                "memory/model_state_bytes_rank0", "memory/model_state_bytes_rank1"):
        assert tag in tags, tags
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert len(losses) == 10
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5  # visibly learns
