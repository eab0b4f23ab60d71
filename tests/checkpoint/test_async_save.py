"""Asynchronous saves (issue 30), world 2, ZeRO-3: the step is blocked only while its state is staged;
the checkpoint is the same bytes as a synchronous save of that step, verified and sealed; a full disk
surfaces on every rank; a save due while one is writing waits for it or is skipped."""

from __future__ import annotations

import pytest
from async_harness import async_worker
from tmpfs import tmpfs_mounter

from deepshard.launch.local import launch_local


@pytest.fixture(scope="module")
def results(tmp_path_factory, mount_tmpfs):
    tmp = tmp_path_factory.mktemp("async")
    small = mount_tmpfs("2m")
    return launch_local(async_worker, 2, str(tmp / "scratch"), str(small))


@pytest.fixture(scope="module")
def mount_tmpfs(tmp_path_factory):  # module-scoped twin of tests/conftest.py's (one launch serves the module)
    yield from tmpfs_mounter(lambda: tmp_path_factory.mktemp("tmpfs"))


def test_async_every_step_verifies_and_resumes_bit_exact(results):
    for r in results:
        assert [s for s, ok, sealed in r["outcomes"]] == [1, 2, 3, 4]
        assert all(ok and sealed for _, ok, sealed in r["outcomes"])
        assert r["verified"] == [4, 3, 2, 1]
        # the writer started late, after the next step had trained: the shards are still those of the save's step
        assert r["same_shards"] == [True] * 4
        assert r["same_state"] and r["same_as_trained"] and r["app"] == {"step": 4}
        loss_async, loss_sync, loss_straight = r["next_loss"]
        assert loss_async == loss_sync == loss_straight
        assert r["staging_bytes"] > 0
        assert max(r["blocked"]) < min(r["write_s"])  # staging, not writing, is what the step waits for


def test_async_policy_wait_or_skip(results):
    for r in results:
        skip, wait = r["skip"], r["wait"]
        assert skip["go"] is False and skip["waited"] is False and skip["seconds"] < 1.0
        assert skip["steps"] == [5]
        assert wait["go"] is True and wait["waited"] == 5 and wait["seconds"] >= 1.4
        assert wait["steps"] == [6, 5]


def test_async_full_disk_surfaces_on_every_rank_and_keeps_the_previous(results):
    lines = {r["enospc"] for r in results}
    assert len(lines) == 1  # the same line on both ranks
    (line,) = lines
    assert "saving step 2 failed: the disk is full" in line and "removed the partial step-00000002.tmp-" in line
    assert "\n" not in line
    for r in results:
        assert r["first_ok"]
        assert r["after_enospc"]["steps"] == [1] and r["after_enospc"]["temp"] == []
        assert r["after_enospc"]["entries"] == ["filler", "step-00000001"]
