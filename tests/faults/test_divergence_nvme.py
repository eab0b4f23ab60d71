"""The parameter-norm divergence check under ``offload.params=nvme`` (issue 43): the real app at world 1
(tiny model, fp32, ZeRO-3 with its params and states on NVMe).

There a step's update is deferred to each unit's next use, so the norm of the state it leaves is taken
where it is applied (piece by piece, in the next forward) and judged at the next step, naming the step
whose update it was; a step that saves a checkpoint applies its update first, so no blown state is
ever saved.  ``optim.lr=1e9`` blows the weights up in one step: before, the norm was never measured
under NVMe params and the blown step passed for good."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepshard.core.checkpoint.manifest import step_dirs

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "data.seq_len=64", "train.log_every=1", "data.num_docs=600", "launcher.nproc_per_node=1", "precision=fp32",
        "+zero=stage3", "+offload=nvme", "offload.params=nvme"]

pytestmark = pytest.mark.slow


def test_lr_1e9_under_nvme_params_is_named_at_the_update_that_blew_up(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "apps/finetune/main.py"), *TINY, f"offload.nvme_path={swap}", "optim.lr=1e9",
           "train.max_steps=3", "checkpoint.every_steps=3", "checkpoint.keep_last=0", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 1, out[-3000:] + err[-3000:]
    said = [line for line in (out + err).splitlines() if "warning: step " in line]
    # step 1's update is applied in step 2's forward: judged there, naming step 1 as the cause
    assert said and said[0].split("warning: ", 1)[1].startswith(
        "step 2: the update of step 1 blew the parameters up (norm "), said
    norm = float(said[0].split("(norm ", 1)[1].split(",")[0])
    assert math.isfinite(norm) and norm > 1e6, said[0]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: training diverged at step 3: "), errors
    assert step_dirs(run_dir / "checkpoints") == []  # the last step's save applied its update first: withheld
    assert "done:" not in out
