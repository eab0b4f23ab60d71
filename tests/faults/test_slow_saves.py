"""Slow, hung and cut-short saves in the real app at world 2 (issue 45), three launches in all.

``DEEPSHARD_FAULT_SAVE_STALL=2:5:slow`` makes the save of step 2 a slow writer that still writes (its
shard trickles out over 5 s, each piece reported as progress); ``4:60`` makes the save of step 4 a hung
one (it writes nothing for 60 s).  With ``launcher.hang_s=3`` the slow save must be sealed and training
go on, sync and async, while the silent one is still a hang.  With ``launcher.shutdown_grace_s=2`` a
SIGTERM during the silent save must end with a line that says the save was cut short and which step a
rerun resumes from (exit 1), not that a checkpoint was written.  The sync launch also runs at ZeRO-3
with the vocabulary-tiled embedding and ``DEEPSHARD_TEST_FAULT=nan@3:1``: the NaN must reach the step.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deepshard.core.checkpoint.manifest import latest_good, step_dirs, verify_checkpoint
from deepshard.core.checkpoint.retention import temp_dirs
from tests.app_runner import run_main
from tests.faults.run_harness import MAIN, TINY

pytestmark = pytest.mark.slow
HANG_S, SLOW_S, GRACE_S = 3, 5, 2  # the slow save outlasts hang_s by 2 s, as before
STALLS = f"2:{SLOW_S}:slow,4:60"
SILENT = "DEEPSHARD_FAULT_SAVE_STALL=4:60: pausing this save"
ARGS = ("train.max_steps=100", "checkpoint.every_steps=2", f"launcher.hang_s={HANG_S}",
        f"launcher.shutdown_grace_s={GRACE_S}")


@dataclass
class Ended:
    code: int
    out: str
    root: Path
    signalled_at: float | None  # time.monotonic() of the SIGTERM, if one was sent
    ended_at: float

    @property
    def last(self) -> str:
        return self.out.strip().splitlines()[-1]


def _launch(tmp: Path, *overrides: str, env: dict[str, str], sigterm_on: str | None = None,
            timeout: float = 120) -> Ended:
    """Run the app in its own session (SIGTERM to its process group once ``sigterm_on`` is logged);
    whatever happens, nothing it started outlives this call."""
    run = tmp / "run"
    proc = subprocess.Popen([sys.executable, str(MAIN), *TINY, *ARGS, *overrides, f"hydra.run.dir={run}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put(None)], daemon=True).start()
    out, signalled = "", None
    deadline = time.monotonic() + timeout
    try:
        while (line := lines.get(timeout=max(0.1, deadline - time.monotonic()))) is not None:
            out += line
            if sigterm_on and signalled is None and sigterm_on in line:
                signalled = time.monotonic()
                os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (queue.Empty, subprocess.TimeoutExpired):
        pytest.fail(f"the run did not end within {timeout} s:\n{out[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return Ended(proc.returncode, out, run / "checkpoints", signalled, time.monotonic())


def _run(tmp: Path, *overrides: str, env: dict[str, str]) -> Ended:
    """A launch that nothing signals (its launcher's watchdog ends it): through the pytest worker's app
    runner (tests/app_runner.py), which forks its launcher and workers for it; its stdout, then its stderr."""
    run = tmp / "run"
    proc = run_main([*TINY, *ARGS, *overrides, f"hydra.run.dir={run}"], cwd=tmp, timeout=120,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    return Ended(proc.returncode, proc.stdout + proc.stderr, run / "checkpoints", None, time.monotonic())


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory) -> Iterator[Ended]:
    """Sync saves at ZeRO-3 with the tiled embedding: NaN at step 3 only, slow save of step 2, silent one
    of step 4 left to the hang watchdog."""
    yield _run(tmp_path_factory.mktemp("sync"), "+zero=stage3", "model.vocab_tile_size=256",
               env={"DEEPSHARD_FAULT_SAVE_STALL": STALLS, "DEEPSHARD_TEST_FAULT": "nan@3:1"})


@pytest.fixture(scope="module")
def async_run(tmp_path_factory) -> Iterator[Ended]:
    """Async saves: the step-4 save waits for the slow one of step 2; SIGTERM during the silent one."""
    yield _launch(tmp_path_factory.mktemp("async"), "checkpoint.async_save=true", "checkpoint.async_policy=wait",
                  env={"DEEPSHARD_FAULT_SAVE_STALL": STALLS}, sigterm_on=SILENT)


@pytest.fixture(scope="module")
def sync_preempted(tmp_path_factory) -> Iterator[Ended]:
    """Sync saves: SIGTERM during the silent save of step 4."""
    yield _launch(tmp_path_factory.mktemp("sync-preempt"), env={"DEEPSHARD_FAULT_SAVE_STALL": "4:60"},
                  sigterm_on=SILENT)


def _save_seconds(out: str, step: int) -> float:
    sync = re.search(rf"saved \S+step-{step:08d} \([\d.]+ MB\) in ([\d.]+)s", out)
    assert sync, out[-3000:]
    return float(sync[1])


def test_a_slow_sync_save_that_writes_is_sealed_and_a_silent_one_is_still_a_hang(sync_run):
    assert _save_seconds(sync_run.out, 2) >= SLOW_S > HANG_S  # the slow save outlived hang_s...
    verify_checkpoint(sync_run.root / "step-00000002")  # ...was sealed...
    assert re.search(r"step\s+4\s+loss", sync_run.out)  # ...and training went on
    assert sync_run.code == 1, sync_run.out[-3000:]  # the save of step 4 wrote nothing for hang_s
    hang = re.fullmatch(r"error: rank \d has made no progress since step 4 \(checkpoint\) for (\d+) s", sync_run.last)
    assert hang and int(hang[1]) >= HANG_S, sync_run.out[-3000:]  # the seconds it saw: hang_s or a poll more
    assert [p.name.split(".")[0] for p, _, _ in temp_dirs(sync_run.root)] == ["step-00000004"]


def test_a_slow_async_save_that_writes_outlives_hang_s_while_training_waits_for_it(async_run):
    sealed = re.search(r"step 2 sealed \S+ \([\d.]+ MB\): training blocked [\d.]+s, sealed ([\d.]+)s after",
                       async_run.out)
    assert sealed and float(sealed[1]) >= SLOW_S, async_run.out[-3000:]
    # the save of step 4 (checkpoint.async_policy=wait) waited for it, with no step marked meanwhile
    assert async_run.out.index("step 2 sealed") < async_run.out.index("step 4 staged")
    assert "has made no progress" not in async_run.out
    verify_checkpoint(async_run.root / "step-00000002")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_preemption_whose_save_misses_the_grace_says_so_and_exits_1(mode, request):
    run: Ended = request.getfixturevalue({"sync": "sync_preempted", "async": "async_run"}[mode])
    assert run.code == 1, run.out[-3000:]
    step = int(re.match(r"error: preempted \(SIGTERM\) at step (\d+): ", run.last)[1])
    newest, _ = latest_good(run.root)  # what checkpoint.resume=auto will take, checksums included
    assert newest == run.root / "step-00000002" and [c.step for c in step_dirs(run.root)] == [2]
    (partial,) = [p.name for p, _, _ in temp_dirs(run.root)]
    assert partial.startswith("step-00000004.tmp-")
    assert run.last == (f"error: preempted (SIGTERM) at step {step}: step {step} was not saved: its save was cut "
                        f"short: the workers were killed launcher.shutdown_grace_s={GRACE_S} s after the signal, "
                        f"with a save unfinished (the partial {partial} is left); a rerun with "
                        f"checkpoint.resume=auto resumes from step 2 ({newest})")
    assert "wrote a checkpoint" not in run.out
    assert run.ended_at - run.signalled_at < GRACE_S + 15


def test_the_nan_fault_reaches_the_tiled_embedding_at_zero3(sync_run):
    assert "zero stage 3" in sync_run.out
    assert re.search(r"step\s+3\s+loss nan .*grad_norm nan", sync_run.out), sync_run.out[-3000:]
    assert "warning: step 3: non-finite loss and gradient norm" in sync_run.out  # the divergence guard reacted
    assert re.search(r"step\s+4\s+loss \d+\.\d+ ", sync_run.out)  # nan@3:1: one step only, then finite again
