"""Retention never deletes the checkpoint just written nor the newest good one; a corrupt checkpoint
does not count toward keep_last; an abandoned branch is renamed aside; only dead runs' temp dirs go."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from deepshard.core.checkpoint import find_resume
from deepshard.core.checkpoint_manifest import (
    FORMAT,
    OWNER,
    describe_files,
    latest_good,
    prune,
    set_aside,
    step_dir_name,
    step_dirs,
    temp_dirs,
    write_manifest,
)


def _ckpt(root, step: int, *, corrupt: bool = False):
    """A sealed checkpoint directory with one data file (``corrupt``: its bytes no longer match)."""
    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    write_manifest(path, {"format": FORMAT, "step": step, "files": describe_files(path, ["__0_0.distcp"])})
    if corrupt:
        (path / "__0_0.distcp").write_bytes(bytes(1024))
    return path


def _steps(root) -> list[int]:
    return [c.step for c in step_dirs(root)]


def test_fallback_past_a_corrupt_newest_keeps_the_good_one_with_keep_last_1(tmp_path):
    """The reported sequence: step-15 corrupt, resume falls back to 10, saves 12 with keep_last=1."""
    _ckpt(tmp_path, 10)
    _ckpt(tmp_path, 15, corrupt=True)
    found, skipped = latest_good(tmp_path)
    assert found == tmp_path / "step-00000010" and "step-00000015" in skipped[0]
    moved = set_aside(tmp_path, 10)  # what the app does after resuming step 10
    assert [(a.name, b.name.startswith("abandoned-step-00000015-")) for a, b in moved] == [("step-00000015", True)]
    new = _ckpt(tmp_path, 12)
    prune(tmp_path, keep_last=1, keep=[new])
    assert _steps(tmp_path) == [12]
    assert latest_good(tmp_path)[0] == new  # the next resume=auto uses it
    assert any(p.name.startswith("abandoned-step-00000015-") for p in tmp_path.iterdir())  # kept for a look


def test_a_corrupt_checkpoint_never_pushes_out_the_newest_good_one(tmp_path):
    _ckpt(tmp_path, 5)
    _ckpt(tmp_path, 8, corrupt=True)
    _ckpt(tmp_path, 10, corrupt=True)
    prune(tmp_path, keep_last=1)
    assert _steps(tmp_path) == [10, 8, 5]  # 5 is the newest that verifies; the corrupt ones don't count
    _ckpt(tmp_path, 12)
    _ckpt(tmp_path, 14)
    prune(tmp_path, keep_last=2)
    assert _steps(tmp_path) == [14, 12]


def test_the_checkpoint_just_written_is_never_removed(tmp_path):
    _ckpt(tmp_path, 20)
    _ckpt(tmp_path, 30)
    just = _ckpt(tmp_path, 10)  # e.g. written after resume=PATH of an older step, before set_aside
    prune(tmp_path, keep_last=1, keep=[just], is_good=lambda p: False)
    assert 10 in _steps(tmp_path)


def test_resume_path_of_an_older_step_sets_the_newer_ones_aside(tmp_path):
    for s in (5, 10, 15):
        _ckpt(tmp_path, s)
    set_aside(tmp_path, 5)
    assert _steps(tmp_path) == [5]
    assert sorted(p.name[:len("abandoned-step-00000010")] for p in tmp_path.iterdir()
                  if p.name.startswith("abandoned-")) == ["abandoned-step-00000010", "abandoned-step-00000015"]
    assert latest_good(tmp_path)[0] == tmp_path / "step-00000005"


def _temp(root, name: str, owner: dict | None):
    p = root / name
    p.mkdir()
    if owner is not None:
        (p / OWNER).write_text(json.dumps(owner))
    return p


@pytest.fixture
def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_dead_runs_temp_dirs_are_removed_and_each_is_logged(tmp_path, dead_pid, caplog):
    _ckpt(tmp_path, 4)
    host = socket.gethostname()
    live = _temp(tmp_path, "step-00000006.tmp-live0001", {"host": host, "pid": os.getpid()})
    dead = _temp(tmp_path, "step-00000006.tmp-dead0001", {"host": host, "pid": dead_pid})
    remote = _temp(tmp_path, "step-00000006.tmp-remote01", {"host": host + "-elsewhere", "pid": 1,
                                                            "started": time.time()})
    old_remote = _temp(tmp_path, "step-00000006.tmp-remote02", {"host": host + "-elsewhere", "pid": 1,
                                                                "started": time.time() - 7 * 3600})
    orphan = _temp(tmp_path, "step-00000006.tmp-orphan01", None)
    assert {p.name: alive for p, alive, _ in temp_dirs(tmp_path)} == {
        live.name: True, dead.name: False, remote.name: True, old_remote.name: False, orphan.name: False}
    with caplog.at_level(logging.WARNING, logger="deepshard.checkpoint"):
        assert find_resume(tmp_path) == tmp_path / "step-00000004"
    assert live.is_dir() and remote.is_dir() and not dead.exists() and not orphan.exists() and not old_remote.exists()
    assert f"{dead.name} is an unfinished save of a dead run (pid {dead_pid}): skipped and removed" in caplog.text
    assert f"{live.name} is an unfinished save still being written (pid {os.getpid()})" in caplog.text
    prune(tmp_path, keep_last=1)  # retention leaves a live concurrent save alone too
    assert live.is_dir() and remote.is_dir()
