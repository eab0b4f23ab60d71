"""Checkpoint faults injected into the real app (world 2, tiny model), each bounded in time: SIGTERM
mid-save, a full checkpoint dir, kill -9 mid-save, then (on copies of what that run left) resume=auto
past its partial save and a corrupt checkpoint with keep_last=1, and a crafted ``.metadata`` on
resume=PATH and on export.

"Mid-save" is made exact by ``DEEPSHARD_FAULT_SAVE_STALL=STEP:SECONDS``: the save of STEP pauses with
its shards written and its manifest not yet, and says so in the log; the test signals then.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deepshard.core.checkpoint.manifest import latest_good, step_dirs, verify_checkpoint
from deepshard.core.checkpoint.retention import temp_dirs
from deepshard.finetune.tools.export import main as export_main
from tests.app_runner import run_main
from tests.checkpoint.malicious import poison_metadata
from tests.finetune_app.app_harness import MAIN, TINY

pytestmark = pytest.mark.slow
PAUSED = "pausing this save for a fault-injection test"


def _args(run_dir: Path, *overrides: str) -> list[str]:
    return [*TINY, "train.log_every=1", *overrides, f"hydra.run.dir={run_dir}"]


def _cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(MAIN), *_args(run_dir, *overrides)]


def _run(cwd: Path, run_dir: Path, *overrides: str, timeout: int = 180) -> tuple[int, str]:
    proc = run_main(_args(run_dir, *overrides), cwd=cwd, timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc.returncode, proc.stdout + proc.stderr


class Live:
    """The app in its own session, its output read on a thread so waits can time out."""

    def __init__(self, cwd: Path, run_dir: Path, *overrides: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(_cmd(run_dir, *overrides), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=cwd, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1", **env))
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.text = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                break
            self.text += line
            if needle in line:
                return
        self.kill(signal.SIGKILL)
        pytest.fail(f"no {needle!r} within {timeout}s:\n{self.text[-3000:]}")

    def kill(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def finish(self, timeout: float) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            pytest.fail(f"still running {timeout}s after the signal:\n{self.text[-3000:]}")
        while (line := self.lines.get(timeout=10)) is not None:
            self.text += line
        return self.proc.returncode, self.text


def _steps(root: Path) -> list[int]:
    return [c.step for c in step_dirs(root)]


def test_sigterm_mid_save_completes_the_save_and_exits_cleanly(tmp_path):
    run = tmp_path / "run"
    app = Live(tmp_path, run, "checkpoint.every_steps=2", "train.max_steps=200", env={
        "DEEPSHARD_FAULT_SAVE_STALL": "4:3"})
    app.wait_for(PAUSED, timeout=120)
    start = time.monotonic()
    app.kill(signal.SIGTERM)
    code, out = app.finish(timeout=60)
    assert code == 0, out[-3000:]
    assert "preempted" in out and time.monotonic() - start < 45
    root = run / "checkpoints"
    assert 4 in _steps(root) and max(_steps(root)) <= 6, _steps(root)
    newest = max(_steps(root))  # the line says what is on disk: the step reached, sealed
    assert f"preempted (SIGTERM): saved step {newest} ({root / f'step-{newest:08d}'}, sealed)" in out, out[-3000:]
    for c in step_dirs(root):
        verify_checkpoint(c.path)
    assert temp_dirs(root) == []


@pytest.fixture
def small_tmpfs(mount_tmpfs):
    """A 1 MB tmpfs (tests/conftest.py's mount_tmpfs)."""
    return mount_tmpfs("1m")


def test_a_full_checkpoint_dir_stops_or_continues_as_asked(tmp_path, small_tmpfs):
    """A ~5 MB checkpoint into a 1 MB tmpfs: refused up front with the sizes, nothing left behind."""
    code, out = _run(tmp_path, tmp_path / "run1", f"checkpoint.dir={small_tmpfs}", "checkpoint.every_steps=2",
                     "checkpoint.on_error=continue", "train.max_steps=3")
    assert code == 0, out[-3000:]
    assert f"checkpoint.dir={small_tmpfs}: saving step 2 failed: needs " in out and " MB free" in out
    assert "training on (checkpoint.on_error=continue)" in out and "step     3" in out
    assert list(small_tmpfs.iterdir()) == []

    code, out = _run(tmp_path, tmp_path / "run2", f"checkpoint.dir={small_tmpfs}", "train.max_steps=1")
    assert code != 0
    assert f"checkpoint.dir={small_tmpfs}: saving step 1 failed: needs " in out, out[-3000:]
    assert list(small_tmpfs.iterdir()) == []


@pytest.fixture(scope="module")
def killed_mid_save(tmp_path_factory):
    """A run killed with -9 (the whole job, as when a node dies) while it saved step 6: steps 2 and 4
    are good checkpoints, step 6 has its shards written and no manifest.  One launch serves the tests
    below; each works on a copy."""
    tmp = tmp_path_factory.mktemp("killed")
    run = tmp / "run"
    app = Live(tmp, run, "checkpoint.every_steps=2", "checkpoint.keep_last=0", "train.max_steps=200", env={
        "DEEPSHARD_FAULT_SAVE_STALL": "6:120"})
    app.wait_for(PAUSED, timeout=120)
    app.kill(signal.SIGKILL)
    app.finish(timeout=30)
    return run / "checkpoints"


def test_kill_9_mid_save_leaves_the_good_checkpoints_and_one_partial(killed_mid_save):
    root = killed_mid_save
    (partial,) = [p for p, _, _ in temp_dirs(root)]
    assert partial.name.startswith("step-00000006.tmp-") and (partial / ".metadata").is_file()
    assert _steps(root) == [4, 2]
    for c in step_dirs(root):
        verify_checkpoint(c.path)


def test_resume_auto_past_a_partial_and_a_corrupt_checkpoint_then_keep_last_1(tmp_path, killed_mid_save):
    """resume=auto skips (and removes) the dead run's unfinished save, falls back past step 4, whose
    shard fails its checksum, to step 2, sets step 4 aside as an abandoned branch, and keep_last=1
    then keeps only the newest good one of this run."""
    run = tmp_path / "run"
    shutil.copytree(killed_mid_save, run / "checkpoints")
    root = run / "checkpoints"
    (partial,) = [p for p, _, _ in temp_dirs(root)]
    shard = sorted((root / "step-00000004").glob("__*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    code, out = _run(tmp_path, run, "checkpoint.keep_last=1", "checkpoint.every_steps=2", "train.max_steps=5")
    assert code == 0, out[-3000:]
    assert f"{partial.name} is an unfinished save of a dead run" in out and "skipped and removed" in out
    assert not partial.exists() and temp_dirs(root) == []
    assert "fails its crc32 checksum" in out and f"resumed from {root / 'step-00000002'} at step 2" in out
    assert "a branch this run abandons" in out
    assert _steps(root) == [5]  # the newest survives retention (step 4 of this run went); the corrupt 4 never counted
    verify_checkpoint(root / "step-00000005")
    assert latest_good(root)[0] == root / "step-00000005"  # what the next resume=auto takes
    assert [p.name[:len("abandoned-step-00000004")] for p in root.iterdir() if p.name.startswith("abandoned-")] == [
        "abandoned-step-00000004"]


def test_a_crafted_metadata_is_refused_on_resume_and_export_and_runs_nothing(tmp_path, killed_mid_save):
    """At world 1 (the refusal is each rank's own load, before any collective)."""
    ckpt = tmp_path / "step-00000002"
    shutil.copytree(killed_mid_save / "step-00000002", ckpt)
    marker = tmp_path / "pwned"
    poison_metadata(ckpt, marker)
    code, out = _run(tmp_path, tmp_path / "run", f"checkpoint.resume={ckpt}", "train.max_steps=3",
                     "launcher.nproc_per_node=1")
    assert code != 0
    assert f"'{ckpt / '.metadata'}' asks to load posix.system, which is not part of DCP's metadata" in out, out[-3000:]
    assert not marker.exists()
    assert export_main([str(ckpt), str(tmp_path / "exported")]) == 2
    assert not marker.exists()
