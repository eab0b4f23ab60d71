"""The parameter swap's files are scratch too: a ZeRO-Infinity app run (``+zero=stage3 +offload=nvme
offload.params=nvme``, world 2) whose worker is SIGKILLed mid-run leaves nothing under
``offload.nvme_path``.  One launch covers both ways a worker ends badly: rank 1 is killed (no
cleanup of its own can run: the launcher's sweep of the run's scratch dir removes its files) and
rank 0 then raises (its peer is gone) and goes down through its own error path."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "apps/finetune/main.py"
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "data.seq_len=64", "train.log_every=1", "optim.lr=0.01", "data.num_docs=600"]


def _swap_files(nvme: Path) -> list[Path]:
    return sorted(p for p in nvme.rglob("*") if p.is_file())


@pytest.mark.slow
def test_a_killed_worker_leaves_no_param_swap_files(tmp_path):
    nvme, run_dir = tmp_path / "nvme", tmp_path / "run"
    nvme.mkdir()
    cmd = [sys.executable, str(MAIN), *TINY, "+zero=stage3", "+offload=nvme", f"offload.nvme_path={nvme}",
           "offload.params=nvme", "train.max_steps=100000", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    timer = threading.Timer(240, lambda: os.killpg(proc.pid, signal.SIGKILL))  # a hang fails, never blocks
    timer.start()
    pid = None
    try:
        seen = ""
        for line in proc.stdout:
            seen += line
            if re.search(r"step\s+3\s+loss", line):
                break
        else:
            raise AssertionError(f"the run ended before step 3: {seen[-2000:]}{proc.stderr.read()[-2000:]}")
        files = _swap_files(nvme)
        for rank in (0, 1):  # params, grads and both moments of each rank, in the run's scratch dir
            names = {p.name for p in files if f"rank{rank}" in p.parts}
            assert {"param.swp", "grad.swp", "exp_avg.swp", "exp_avg_sq.swp"} <= names, files
        pid = int(json.loads((run_dir / "heartbeat" / "rank1.json").read_text())["pid"])
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    finally:
        timer.cancel()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    assert elapsed < 60
    assert re.fullmatch(r"error: rank 1 died with SIGKILL( during step \d+ \(\w+\))?",
                        err.strip().splitlines()[-1]), err[-3000:]
    assert _swap_files(nvme) == [] and list(nvme.iterdir()) == [], _swap_files(nvme) or list(nvme.iterdir())
