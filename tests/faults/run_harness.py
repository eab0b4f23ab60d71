"""What the fault tests share: the app's tiny model and a wait for a step's log line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "apps/finetune/main.py"
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "data.seq_len=64", "train.log_every=1", "optim.lr=0.01", "data.num_docs=600"]


def wait_for_step(proc: subprocess.Popen, step: int, timeout: float = 120) -> str:
    """stdout up to the log line of ``step`` (rank 0 logs every step); a silent hang is killed at ``timeout``."""
    seen = ""
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    try:
        for line in proc.stdout:
            seen += line
            if re.search(rf"step\s+{step}\s+loss", line):
                return seen
    finally:
        timer.cancel()
    raise AssertionError(f"the run ended before step {step}: {seen[-2000:]}{proc.stderr.read()[-2000:]}")
