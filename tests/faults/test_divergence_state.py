"""The state after an update decides what is good: the real app at world 1 (tiny model, fp32).

``optim.lr=1e9`` keeps the loss finite for a step while the update blows the weights up by ~1e8:
no checkpoint of such a state is saved or named the newest good one, and the run exits 1 with one
line, also when it ends (``train.max_steps``) before ``train.max_bad_steps`` bad steps.  A run that
resumes into NaN stops like any other; a SIGTERM during a streak of bad steps stops the run without
a save; the steps of a streak count toward the tokens seen.  ``checkpoint.resume=auto`` with only
corrupt checkpoints is an error unless ``checkpoint.resume=auto_or_fresh``; a failed final save
under ``checkpoint.on_error=continue`` is said in the ``done:`` line.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deepshard.core.checkpoint.consolidate import iter_full_tensors
from deepshard.core.checkpoint.manifest import step_dirs
from tests.app_runner import run_main

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "apps/finetune/main.py"
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "data.seq_len=64", "train.log_every=1", "optim.lr=0.01", "data.num_docs=600", "launcher.nproc_per_node=1",
        "precision=fp32"]
# the init's largest weight is 1.0 (the RMSNorm gains; matrices are N(0, 0.02)): lr=1e9 takes weights
# to ~1e8 in one step, a sane run stays within a few times the init
INIT_MAX = 1.0

pytestmark = pytest.mark.slow


def _args(run_dir: Path, *overrides: str) -> list[str]:
    return [*TINY, *overrides, f"hydra.run.dir={run_dir}"]


def _cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(MAIN), *_args(run_dir, *overrides)]


def _run(run_dir: Path, *overrides: str, fault: str | None = None, timeout: int = 180) -> tuple[int, str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if fault:
        env["DEEPSHARD_TEST_FAULT"] = fault
    proc = run_main(_args(run_dir, *overrides), cwd=run_dir.parent, timeout=timeout, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def _weights_max(path: Path) -> float:
    """The largest |w| over the checkpoint's model weights (NaN where any is not finite)."""
    worst = 0.0
    for _, t in iter_full_tensors(path, "model."):
        if not t.isfinite().all():
            return math.nan
        worst = max(worst, t.abs().max().item())
    return worst


def _tokens_seen(path: Path) -> int:
    return json.loads((path / "trainer.json").read_text())["app"]["tokens_seen"]


def test_lr_1e9_saves_no_exploded_checkpoint_and_names_a_finite_one(tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = _run(run_dir, "optim.lr=1e9", "checkpoint.every_steps=1", "checkpoint.keep_last=0",
                          "train.max_steps=10")
    assert code == 1, out[-3000:] + err[-3000:]
    (line,) = _errors(err)
    assert line.startswith("error: training diverged at step "), line
    saved = step_dirs(run_dir / "checkpoints")
    assert saved, out[-3000:]
    for c in saved:  # every checkpoint on disk is a good one: finite, not blown up
        assert _weights_max(c.path) <= 10 * INIT_MAX, (c.path, _weights_max(c.path))
    assert f"newest good checkpoint: {saved[0].path};" in line, line
    assert "done:" not in out


def test_lr_1e9_ending_at_max_steps_exits_1_not_done(tmp_path):
    run_dir = tmp_path / "run"
    code, out, err = _run(run_dir, "optim.lr=1e9", "train.max_steps=3")
    assert code == 1, out[-3000:] + err[-3000:]
    (line,) = _errors(err)
    assert line.startswith("error: training diverged at step 3: "), line
    assert "newest good checkpoint: none written yet;" in line, line
    assert "done:" not in out
    assert step_dirs(run_dir / "checkpoints") == []  # the end's save of an exploded state is withheld


@pytest.fixture(scope="module")
def nan_streak(tmp_path_factory) -> tuple[int, str, str, Path]:
    """A run whose steps 3-4 are NaN (skipped) and 5-6 recover, saving every 2 steps: its exit code,
    stdout, stderr and checkpoints folder.  Its step-2 checkpoint is also the good start the tests
    below resume from (a copy)."""
    run_dir = tmp_path_factory.mktemp("streak") / "run"
    code, out, err = _run(run_dir, "train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=0",
                          fault="nan@3:2")
    return code, out, err, run_dir / "checkpoints"


@pytest.fixture(scope="module")
def saved_at_2(nan_streak, tmp_path_factory) -> Path:
    """2 good steps, saved at step 2 (a checkpoints folder holding only that; tests copy it)."""
    code, out, err, root = nan_streak
    assert code == 0, out[-3000:] + err[-3000:]
    saved = tmp_path_factory.mktemp("saved") / "checkpoints"
    shutil.copytree(root / "step-00000002", saved / "step-00000002")
    return saved


def _copy(saved: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir / "checkpoints")
    return run_dir


@pytest.mark.parametrize("max_steps", [10, 4])
def test_a_resumed_run_that_is_nan_from_its_first_step_stops(tmp_path, saved_at_2, max_steps):
    """max_steps=10: stops at max_bad_steps (3) naming the resumed checkpoint; max_steps=4: two bad
    steps then the end, still exit 1 (no 'done' over a non-finite final state)."""
    run_dir = _copy(saved_at_2, tmp_path)
    resumed = run_dir / "checkpoints" / "step-00000002"
    code, out, err = _run(run_dir, f"train.max_steps={max_steps}", fault="nan@3")
    assert code == 1, out[-3000:] + err[-3000:]
    (line,) = _errors(err)
    stop = 5 if max_steps == 10 else 4
    assert line.startswith(f"error: training diverged at step {stop}: "), line
    assert f"newest good checkpoint: {resumed};" in line, line
    assert "done:" not in out
    assert [c.step for c in step_dirs(run_dir / "checkpoints")] == [2]


def test_bad_steps_count_toward_the_tokens_seen(nan_streak):
    """Steps 3-4 are NaN (skipped), 5-6 recover: step 6's checkpoint has seen 6 steps of tokens."""
    code, out, err, root = nan_streak
    assert code == 0, out[-3000:] + err[-3000:]
    assert len(re.findall(r"warning: step [34]: non-finite", out)) == 2
    assert [c.step for c in step_dirs(root)] == [6, 2]  # step 4's save is withheld (bad state)
    assert _tokens_seen(root / "step-00000006") == 3 * _tokens_seen(root / "step-00000002")


def test_sigterm_during_a_streak_of_bad_steps_stops_without_saving(tmp_path):
    run_dir = tmp_path / "run"
    cmd = _cmd(run_dir, "train.max_steps=60", "train.max_bad_steps=100", "checkpoint.every_steps=2",
               "checkpoint.keep_last=0")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", DEEPSHARD_TEST_FAULT="nan@3"),
                            start_new_session=True)
    timer = threading.Timer(120, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    out = ""
    try:
        for line in proc.stdout:
            out += line
            if "warning: step 4: non-finite" in line:
                os.killpg(proc.pid, signal.SIGTERM)
                break
        out += proc.communicate(timeout=60)[0]
    finally:
        timer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    last = max(int(s) for s in re.findall(r"step\s+(\d+)\s+loss", out))
    assert last <= 6, out[-3000:]  # it stopped at the signal, not at max_steps
    newest = run_dir / "checkpoints" / "step-00000002"
    assert (f"preempted after step {last}: nothing saved, the state is not finite ({last - 2} bad steps in a "
            f"row); the newest good checkpoint is {newest}") in out, out[-3000:]
    assert re.search(r"^preempted: steps 1-\d+ .*newest good checkpoint: " + re.escape(str(newest)), out, re.M)
    assert [c.step for c in step_dirs(run_dir / "checkpoints")] == [2]


def test_resume_auto_with_only_corrupt_checkpoints_is_an_error_unless_auto_or_fresh(tmp_path, saved_at_2):
    run_dir = _copy(saved_at_2, tmp_path)
    root = run_dir / "checkpoints"
    shard = sorted((root / "step-00000002").glob("__*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out, err = _run(run_dir, "train.max_steps=3")
    assert code == 2, out[-3000:] + err[-3000:]
    (line,) = _errors(err)
    assert line.startswith(f"error: checkpoint.resume=auto: no usable checkpoint under {root}: "), line
    assert "fails its crc32 checksum" in line and "checkpoint.resume=auto_or_fresh" in line, line
    assert "step     1" not in out  # nothing trained

    code, out, err = _run(run_dir, "train.max_steps=3", "checkpoint.resume=auto_or_fresh")
    assert code == 0, out[-3000:] + err[-3000:]
    assert f"checkpoint: no usable checkpoint under {root}, starting fresh (checkpoint.resume=auto_or_fresh)" in (
        out + err)
    assert re.search(r"^done: steps 1-3 ", out, re.M), out[-3000:]


def test_a_failed_final_save_with_on_error_continue_is_said_in_the_done_line(tmp_path, mount_tmpfs):
    """A 7 MB tmpfs holds step 1's checkpoint (~4.5 MB) but not step 2's beside it."""
    disk = mount_tmpfs("7m")
    run_dir = tmp_path / "run"
    code, out, err = _run(run_dir, f"checkpoint.dir={disk}", "checkpoint.every_steps=1", "checkpoint.keep_last=0",
                          "checkpoint.on_error=continue", "train.max_steps=2")
    assert code == 0, out[-3000:] + err[-3000:]
    assert [c.step for c in step_dirs(disk)] == [1]
    (done,) = [line for line in out.splitlines() if line.startswith("done:")]
    assert re.search(rf"; the final save \(step 2\) failed: needs [\d.]+ MB, [\d.]+ MB free; newest good "
                     rf"checkpoint: {re.escape(str(disk / 'step-00000001'))}$", done), done
