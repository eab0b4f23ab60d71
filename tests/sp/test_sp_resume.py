"""A run under ``parallel.sp=2`` saves and resumes exactly: at ZeRO 1 its optimizer state is sharded over
``dp x sp``, and the checkpoint must say so (a shard over the dp axis alone would claim each rank's half
is the whole tensor).  Reference: the same run uninterrupted; a run resumed from its step-2 checkpoint
must log the same losses at steps 3-4.  Two app launches of 2 ranks (the uninterrupted run saves at
step 2 what the first half of an interrupted one would: the runs are deterministic).  The same
checkpoint also resumes at another ``parallel.sp`` (issue 43): one rank, sp=1, the same rows per step
(Ulysses changes no loss), logs the uninterrupted run's losses at steps 3-4 within 1e-5."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deepshard.core.checkpoint.manifest import step_dirs
from tests.finetune_app.app_harness import run_app, scalars

pytestmark = pytest.mark.slow

MODEL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
         "data.seq_len=64", "data.doc_mask=true", "+zero=stage1", "train.micro_batch_size=2", "train.log_every=1",
         "scheduler=constant", "checkpoint.every_steps=2", "train.max_steps=4"]
RUN = [*MODEL, "launcher.nproc_per_node=2", "parallel.sp=2"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The sp=2 run, uninterrupted: its step-2 checkpoint is what an interrupted one would have saved."""
    whole = tmp_path_factory.mktemp("sp_whole")
    proc = run_app(whole, *RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [c.step for c in step_dirs(whole / "run/checkpoints")] == [4, 2]
    return whole


def _resumed(whole: Path, split: Path, *overrides: str) -> list[float]:
    saved = whole / "run/checkpoints/step-00000002"
    shutil.copytree(saved, split / "run/checkpoints" / saved.name)
    second = run_app(split, *overrides)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr, second.stderr[-3000:]
    return scalars(split / "run/tensorboard")["train/loss"]


def test_sequence_parallel_run_resumes_exactly(whole, tmp_path):
    got = _resumed(whole, tmp_path, *RUN)
    expected = scalars(whole / "run/tensorboard")["train/loss"]
    assert len(expected) == 4 and got[-2:] == pytest.approx(expected[-2:], rel=1e-6), (got, expected)


def test_an_sp2_checkpoint_resumes_at_sp1(whole, tmp_path):
    got = _resumed(whole, tmp_path, *MODEL, "launcher.nproc_per_node=1", "parallel.sp=1")
    expected = scalars(whole / "run/tensorboard")["train/loss"]
    assert got == pytest.approx(expected[-2:], abs=1e-5), (got, expected)
