"""A run under ``parallel.sp=2`` saves and resumes exactly: at ZeRO 1 its optimizer state is sharded over
``dp x sp``, and the checkpoint must say so (a shard over the dp axis alone would claim each rank's half
is the whole tensor).  Reference: the same run uninterrupted; a run resumed from its step-2 checkpoint
must log the same losses at steps 3-4.  Two app launches of 2 ranks (the uninterrupted run saves at
step 2 what the first half of an interrupted one would: the runs are deterministic)."""

from __future__ import annotations

import shutil

import pytest

from deepshard.core.checkpoint.manifest import step_dirs
from tests.finetune_app.app_harness import run_app, scalars

pytestmark = pytest.mark.slow

RUN = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
       "data.seq_len=64", "data.doc_mask=true", "launcher.nproc_per_node=2", "parallel.sp=2", "+zero=stage1",
       "train.micro_batch_size=2", "train.log_every=1", "scheduler=constant", "checkpoint.every_steps=2"]


def test_sequence_parallel_run_resumes_exactly(tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    whole.mkdir()
    proc = run_app(whole, *RUN, "train.max_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = whole / "run/checkpoints/step-00000002"
    assert [c.step for c in step_dirs(whole / "run/checkpoints")] == [4, 2]
    shutil.copytree(saved, split / "run/checkpoints" / saved.name)
    second = run_app(split, *RUN, "train.max_steps=4")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resum" in (second.stdout + second.stderr).lower()
    expected = scalars(whole / "run/tensorboard")["train/loss"]
    got = scalars(split / "run/tensorboard")["train/loss"]
    assert len(expected) == 4 and got[-2:] == pytest.approx(expected[-2:], rel=1e-6), (got, expected)
