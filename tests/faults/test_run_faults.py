"""Faults in a running job, injected into the real app at world 2: each ends the job quickly, non-zero,
with one last line naming the rank and the cause.

A SIGKILLed worker and a SIGSTOPped one are real signals sent from the test to the worker's pid (read
from its heartbeat file), in a launcher of their own (a fresh interpreter).  The NaN is a test-only
hook (``DEEPSHARD_TEST_FAULT=nan@K``) that makes the embedding output NaN from step K, so a real NaN
goes through the loss into every gradient; ``error@K`` raises in rank 1.  Those two runs, which nothing
signals, go through the app runner (tests/app_runner.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepshard.core.checkpoint.manifest import step_dirs, verify_checkpoint
from tests.app_runner import run_main
from tests.faults.run_harness import MAIN, TINY, wait_for_step

pytestmark = pytest.mark.slow


def _start(run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, str(MAIN), *TINY, *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=run_dir.parent,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)


def _worker_pid(run_dir: Path, rank: int) -> int:
    return int(json.loads((run_dir / "heartbeat" / f"rank{rank}.json").read_text())["pid"])


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@contextlib.contextmanager
def _reaped(proc: subprocess.Popen, *pids: int):
    """Whatever happens in the test, nothing it started is left running (stopped workers included)."""
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_sigkill_of_a_worker_ends_the_job_naming_the_rank_and_signal(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "train.max_steps=100000")
    wait_for_step(proc, 3)
    pid = _worker_pid(run_dir, 1)
    with _reaped(proc, pid):
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - t0
    assert proc.returncode == 1, err[-3000:]
    assert elapsed < 30
    assert re.fullmatch(r"error: rank 1 died with SIGKILL( during step \d+ \(\w+\))?", _last_line(err)), err[-3000:]
    assert "Traceback" not in err


@pytest.mark.alone  # named within 2 x hang_s
def test_sigstop_of_a_worker_is_a_hang_that_names_the_stopped_rank(tmp_path):
    hang_s = 4  # the test waits this long (alone: the other worker waits too)
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "train.max_steps=100000", f"launcher.hang_s={hang_s}")
    wait_for_step(proc, 3)
    pid = _worker_pid(run_dir, 1)
    with _reaped(proc, pid):
        t0 = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        _, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - t0
    assert proc.returncode == 1, err[-3000:]
    assert elapsed < 2 * hang_s, elapsed
    line = _last_line(err)
    assert re.fullmatch(r"error: rank 1 has made no progress since step \d+ "
                        r"\((forward|backward|optimizer|eval|checkpoint)\) for \d+ s", line), err[-3000:]
    assert int(line.rsplit("for ", 1)[1].split()[0]) >= hang_s
    assert "Traceback" not in err


def _run(run_dir: Path, *overrides: str, fault: str) -> tuple[int, str, str]:
    """A run that no test signals: through the pytest worker's app runner (tests/app_runner.py), its own
    launcher and workers forked for it; ``DEEPSHARD_TEST_FAULT`` is read while the app runs."""
    proc = run_main([*TINY, *overrides, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, timeout=300,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", "DEEPSHARD_TEST_FAULT": fault})
    return proc.returncode, proc.stdout, proc.stderr


def test_nan_at_step_5_in_fp32_stops_and_the_newest_good_checkpoint_survives(tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = _run(run_dir, "train.max_steps=20", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
                          fault="nan@5")
    assert code == 1, err[-3000:]
    newest = run_dir / "checkpoints" / "step-00000004"
    # steps 5, 6, 7 are non-finite (train.max_bad_steps=3): the run stops at 7 and saves nothing after 4,
    # not even the scheduled save at step 6
    line = _last_line(err)
    assert line.startswith("error: training diverged at step 7: 3 consecutive steps"), err[-3000:]
    assert "last finite loss" in line and "at step 4" in line and f"newest good checkpoint: {newest};" in line
    assert re.search(r"step\s+6\s+loss nan .*grad_norm nan", out)  # a real NaN reached the gradients
    assert len(re.findall(r"warning: step [567]: non-finite loss and gradient norm", out)) == 3
    assert [c.step for c in step_dirs(run_dir / "checkpoints")] == [4, 2]
    assert verify_checkpoint(newest)["world"]["world_size"] == 2


def test_an_error_raised_in_one_worker_is_one_line_with_its_rank(tmp_path):
    run_dir = tmp_path / "run"
    code, _, err = _run(run_dir, "train.max_steps=20", fault="error@3")
    assert code == 2, err[-3000:]
    log = run_dir / "launcher.log"
    # rank 0 then fails too (its peer is gone), but the cause is rank 1's error
    assert _last_line(err) == ("error: rank 1: RuntimeError: injected test fault at step 3 "
                               f"(DEEPSHARD_TEST_FAULT=error@3) (full traceback: {log})")
    assert err.count("error: ") == 1 and "Traceback" not in err
    assert "inject_test_fault" in log.read_text()  # the traceback is kept
