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

from deepshard.core.checkpoint.manifest import (
    FORMAT,
    describe_files,
    latest_good,
    step_dir_name,
    step_dirs,
    write_manifest,
)
from deepshard.core.checkpoint.owners import OWNER
from deepshard.core.checkpoint.retention import prune, set_aside, temp_dirs
from deepshard.core.checkpoint.state import find_resume


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
    live = _temp(tmp_path, "step-00000006.tmp-a1a1a1a1", {"host": host, "pid": os.getpid()})
    dead = _temp(tmp_path, "step-00000006.tmp-deadbeef", {"host": host, "pid": dead_pid})
    remote = _temp(tmp_path, "step-00000006.tmp-0e0e0e01", {"host": host + "-elsewhere", "pid": 1,
                                                            "started": time.time()})
    old_remote = _temp(tmp_path, "step-00000006.tmp-0e0e0e02", {"host": host + "-elsewhere", "pid": 1,
                                                                "started": time.time() - 7 * 3600})
    orphan = _temp(tmp_path, "step-00000006.tmp-00000001", None)  # no marker: no save of ours made it
    assert {p.name: alive for p, alive, _ in temp_dirs(tmp_path)} == {
        live.name: True, dead.name: False, remote.name: True, old_remote.name: False}
    with caplog.at_level(logging.WARNING, logger="deepshard.checkpoint"):
        assert find_resume(tmp_path) == tmp_path / "step-00000004"
    assert live.is_dir() and remote.is_dir() and not dead.exists() and not old_remote.exists()
    assert orphan.is_dir()
    assert f"{dead.name} is an unfinished save of a dead run (pid {dead_pid}): skipped and removed" in caplog.text
    assert f"{live.name} is an unfinished save still being written (pid {os.getpid()})" in caplog.text
    assert f"{orphan.name} is named like a save's temp dir but has no .owner.json" in caplog.text
    prune(tmp_path, keep_last=1)  # retention leaves a live concurrent save alone too
    assert live.is_dir() and remote.is_dir() and orphan.is_dir()

def _user_dir(root, name: str):
    """A directory a user keeps beside the checkpoints, with a file in it."""
    p = root / name
    p.mkdir()
    (p / "notes.txt").write_text("mine\n")
    return p


def test_directories_we_did_not_create_are_never_removed(tmp_path, dead_pid, caplog):
    """Only our own saves' temp dirs (exact names, with the .owner.json marker) and checkpoints (with a
    manifest) are ever removed; names that merely contain .tmp-/.init-/.old-, look-alikes without the
    marker and step-N folders without a manifest are left alone; what is removed is logged."""
    host = socket.gethostname()
    users = [_user_dir(tmp_path, n) for n in (
        "project.tmp-notes", "photos.old-2023", "build.init-cache", "plain",
        "step-00000007.tmp-0123abcd",  # our exact pattern, but no marker: not written by a save of ours
        "step-00000007.old-0123abcd", "step-00000007.init-0123abcd", "step-00000001")]  # step-1: no manifest
    ours = [_temp(tmp_path, f"step-00000006.{kind}-deadbeef", {"host": host, "pid": dead_pid})
            for kind in ("tmp", "init", "old")]
    for p in ours:
        (p / "__0_0.distcp").write_bytes(b"x")
    _ckpt(tmp_path, 2)
    _ckpt(tmp_path, 4)
    with caplog.at_level(logging.INFO, logger="deepshard.checkpoint"):
        assert find_resume(tmp_path) == tmp_path / "step-00000004"
        assert not ours[0].exists() and not ours[1].exists()  # resume=auto removes dead saves' temp dirs
        new = _ckpt(tmp_path, 8)
        prune(tmp_path, keep_last=1, keep=[new])
    assert all((p / "notes.txt").read_text() == "mine\n" for p in users), [p.name for p in users if not p.exists()]
    assert not any(p.exists() for p in ours)
    assert _steps(tmp_path) == [8, 1]  # step-1 is not a checkpoint of ours: retention leaves it
    for p in ours:
        assert p.name in caplog.text
    assert "step-00000002" in caplog.text and "step-00000004" in caplog.text  # retention says what it removed
    assert "step-00000007.tmp-0123abcd" in caplog.text  # a look-alike is named once, left in place


def test_a_user_directory_named_like_the_step_being_saved_is_named_not_replaced(tmp_path):
    """publish never replaces a step-N that is not one of our checkpoints: CheckpointError naming it."""
    from deepshard.core.checkpoint.manifest import CheckpointError, publish
    from deepshard.core.checkpoint.owners import write_owner

    theirs = _user_dir(tmp_path, "step-00000005")
    tmp = tmp_path / "step-00000005.tmp-0badc0de"
    tmp.mkdir()
    write_owner(tmp)
    write_manifest(tmp, {"format": FORMAT, "step": 5, "files": {}})
    with pytest.raises(CheckpointError, match=r"step-00000005.*not a deepshard checkpoint"):
        publish(tmp, tmp_path / "step-00000005")
    assert (theirs / "notes.txt").read_text() == "mine\n"


def _set_aside_names(root) -> list[str]:
    return sorted(p.name[:len("abandoned-step-00000010")] for p in root.iterdir() if p.name.startswith("abandoned-"))


def test_retention_keeps_only_the_newest_checkpoint_set_aside(tmp_path):
    """Each fallback past a corrupt newest renames it aside; under keep_last retention removes the older ones
    and keeps the newest set aside (what a user looks at to see what went wrong); keep_last=0 keeps all."""
    users = _user_dir(tmp_path, "abandoned-step-00000001-mine")  # named like one, no manifest: never ours
    _ckpt(tmp_path, 5)
    _ckpt(tmp_path, 10, corrupt=True)
    set_aside(tmp_path, 5)  # the run fell back to 5 past the corrupt 10
    prune(tmp_path, keep_last=2, keep=[_ckpt(tmp_path, 8)])
    _ckpt(tmp_path, 12, corrupt=True)
    set_aside(tmp_path, 8)
    prune(tmp_path, keep_last=0, keep=[_ckpt(tmp_path, 9)])  # 0 keeps everything, set aside or not
    assert _set_aside_names(tmp_path) == ["abandoned-step-00000001", "abandoned-step-00000010",
                                          "abandoned-step-00000012"]
    removed = prune(tmp_path, keep_last=2, keep=[_ckpt(tmp_path, 11)])
    assert _steps(tmp_path) == [11, 9]
    assert _set_aside_names(tmp_path) == ["abandoned-step-00000001", "abandoned-step-00000012"]
    assert any(p.name.startswith("abandoned-step-00000010-") for p in removed)
    assert (users / "notes.txt").read_text() == "mine\n"
