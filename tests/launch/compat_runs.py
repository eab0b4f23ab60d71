"""Running ``compat_loop.py`` (a DeepSpeed script on deepshard.compat, ZeRO-3) under the ``deepshard``
command, and reading the per-step losses its ranks wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

LOOP = Path(__file__).resolve().with_name("compat_loop.py")
DEEPSHARD = [sys.executable, "-m", "deepshard.launch.cli"]
_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def launch(argv: list[str], cwd: Path, *, env: dict[str, str] | None = None,
           timeout: float = 240) -> tuple[int, str, str]:
    """Run a command in its own session; whatever it started is stopped when this returns."""
    base = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    proc = subprocess.Popen(argv, cwd=cwd, env={**base, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the agents stop their workers on SIGTERM
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_loop(flags: list[str], work: Path, *, env: dict[str, str] | None = None,
             loop_args: tuple[str, ...] = ()) -> tuple[int, str, list[dict]]:
    """``deepshard FLAGS compat_loop.py`` in ``work``: (exit code, stderr, every rank's step rows)."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "losses.jsonl"
    code, _, err = launch([*DEEPSHARD, *flags, str(LOOP), "--ckpt_dir", str(work / "ckpt"), "--out", str(out),
                           *loop_args], work, env=env)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return code, err, rows


def final_losses(rows: list[dict]) -> dict[tuple[int, int], str]:
    """(rank, step) -> the loss (float.hex) of the last attempt that ran the step."""
    out: dict[tuple[int, int], str] = {}
    for row in sorted(rows, key=lambda r: r["attempt"]):
        out[(row["rank"], row["step"])] = row["loss"]
    return out
