"""Half-written, truncated, corrupted or unsealed checkpoints are refused by name; resume=auto
falls back to the newest good one and says why; pruning keeps the newest."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from deepshard.core.checkpoint.manifest import CheckpointError, latest_good, step_dirs, verify_checkpoint
from deepshard.core.checkpoint.owners import OWNER
from deepshard.core.checkpoint.retention import prune
from deepshard.core.checkpoint.state import find_resume, verify_collective


@pytest.fixture
def root(world2, tmp_path):
    _, src = world2
    dst = tmp_path / "ckpts"
    shutil.copytree(src / "stage2", dst)
    return dst


def _shard(path):
    return sorted(path.glob("__*.distcp"))[-1]


def test_intact_checkpoints_verify(root):
    assert [c.step for c in step_dirs(root)] == [10, 5]
    for c in step_dirs(root):
        assert verify_checkpoint(c.path)["step"] == c.step
    assert verify_collective(root / "step-00000010")["world"]["zero_stage"] == 2


def test_truncated_shard_is_named(root):
    shard = _shard(root / "step-00000010")
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"{shard.name} has \d+ bytes.*truncated"):
        verify_checkpoint(root / "step-00000010")


def test_flipped_byte_fails_the_checksum(root):
    shard = _shard(root / "step-00000010")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{shard.name} fails its crc32 checksum"):
        verify_checkpoint(root / "step-00000010")


def test_missing_manifest_means_unfinished(root):
    (root / "step-00000010" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json, so the save never finished"):
        verify_collective(root / "step-00000010")


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        verify_checkpoint(tmp_path / "step-00000001")


def test_auto_resume_falls_back_to_the_previous_good_one_and_says_why(root, caplog):
    shard = _shard(root / "step-00000010")
    shard.write_bytes(shard.read_bytes()[:100])
    (root / "step-00000020.tmp-abcd1234").mkdir()  # an interrupted save is never a candidate
    found, skipped = latest_good(root)
    assert found == root / "step-00000005"
    assert len(skipped) == 1 and "step-00000010" in skipped[0] and "truncated" in skipped[0]
    with caplog.at_level(logging.WARNING, logger="deepshard.checkpoint"):
        assert find_resume(root) == root / "step-00000005"
    assert "skipping" in caplog.text and "truncated" in caplog.text and "step-00000005" in caplog.text


def test_prune_keeps_the_newest_and_removes_temp_dirs(root):
    dead = root / "step-00000020.tmp-abcd1234"  # a save's temp dir (its marker) from a run long gone
    dead.mkdir()
    (dead / OWNER).write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": 0}))
    (root / "step-00000021.tmp-abcd1234").mkdir()  # no marker: not made by a save, left alone
    removed = prune(root, keep_last=1)
    assert [c.step for c in step_dirs(root)] == [10]
    assert {p.name for p in removed} == {"step-00000005", "step-00000020.tmp-abcd1234"}
    assert (root / "step-00000021.tmp-abcd1234").is_dir()
