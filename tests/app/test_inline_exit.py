"""A one-rank run (the app trains in its own process) with its state on NVMe ends and cleans up.

The offload stores' asynchronous I/O runs on a thread pool whose workers wait for work until the
interpreter's exit hooks wake them; the app's fast exit joined every thread first and so waited on
them forever (found with the 450M ZeRO-Infinity bench at world 1: the run trained, saved, and hung).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_one_rank_run_with_params_on_nvme_exits_and_removes_its_swap(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    args = ["launcher.nproc_per_node=1", "train.max_steps=2", "+zero=stage3", "+offload=nvme", "offload.params=nvme",
            f"offload.nvme_path={swap}", f"hydra.run.dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ck'}",
            "checkpoint.resume=none"]
    try:
        out = subprocess.run([sys.executable, str(ROOT / "apps/finetune/main.py"), *args], capture_output=True,
                             text=True, timeout=180, cwd=tmp_path)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the run did not exit: {(hung.stderr or b'')[-800:]!r}")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: steps 1-2" in out.stderr + out.stdout
    assert list(swap.iterdir()) == [], list(swap.iterdir())  # the swap files went with the run
