"""Asynchronous saves (issue 30), world 2, ZeRO-3: the step is blocked only while its state is staged;
the checkpoint is the same bytes as a synchronous save of that step, verified and sealed; a full disk
surfaces on every rank; a save due while one is writing waits for it or is skipped; the writer's group
times out like training's; an asynchronous checkpoint loads at world 1, ZeRO-1, bit for bit."""

from __future__ import annotations

import pytest
import torch

from deepshard.launch.local import launch_local
from tests.checkpoint.async_harness import TIMEOUT_S, async_worker, reshard_worker
from tests.checkpoint.tmpfs import tmpfs_mounter

pytestmark = pytest.mark.slow  # world-size launches: the full suite only (the inner loop: -m 'not slow')


@pytest.fixture(scope="module")
def results(tmp_path_factory, mount_tmpfs):
    tmp = tmp_path_factory.mktemp("async")
    small = mount_tmpfs("2m")
    return launch_local(async_worker, 2, str(tmp / "scratch"), str(small)), tmp / "scratch"


@pytest.fixture(scope="module")
def mount_tmpfs(tmp_path_factory):  # module-scoped twin of tests/conftest.py's (one launch serves the module)
    yield from tmpfs_mounter(lambda: tmp_path_factory.mktemp("tmpfs"))


def test_async_every_step_verifies_and_resumes_bit_exact(results):
    for r in results[0]:
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
    for r in results[0]:
        skip, wait = r["skip"], r["wait"]
        assert skip["go"] is False and skip["waited"] is False and skip["seconds"] < 1.0
        assert skip["steps"] == [5]
        assert wait["go"] is True and wait["waited"] == 5 and wait["seconds"] >= 1.4
        assert wait["steps"] == [6, 5]


def test_async_full_disk_surfaces_on_every_rank_and_keeps_the_previous(results):
    lines = {r["enospc"] for r in results[0]}
    assert len(lines) == 1  # the same line on both ranks
    (line,) = lines
    assert "saving step 2 failed: the disk is full" in line and "removed the partial step-00000002.tmp-" in line
    assert "\n" not in line
    for r in results[0]:
        assert r["first_ok"]
        assert r["after_enospc"]["steps"] == [1] and r["after_enospc"]["temp"] == []
        assert r["after_enospc"]["entries"] == ["filler", "step-00000001"]


def test_the_writer_group_times_out_like_the_training_group(results):
    for r in results[0]:
        assert r["writer_timeout_s"] == TIMEOUT_S  # not gloo's default 30 minutes


def test_an_async_checkpoint_resumes_at_another_world_size_and_stage(results):
    """Saved asynchronously at world 2, ZeRO-3; loaded at world 1, ZeRO-1: every master and moment equal to
    the trained state's, bit for bit (a layout change only moves whole values); the update count and the
    data position come back, and the next step's loss equals the world-2 run's up to summation order."""
    out, scratch = results
    r = launch_local(reshard_worker, 1, str(scratch / "async" / "step-00000004"), 1)[0]
    trained = torch.load(scratch / "trained-step4.pt", weights_only=True)
    assert sorted(r["state"]) == sorted(trained)
    differ = [k for k, v in trained.items() if not torch.equal(r["state"][k], v)]
    assert differ == [], {k: (r["state"][k] - trained[k]).abs().max().item() for k in differ}
    assert r["app"] == {"step": 4} and r["num_updates"] == 4
    world2_next = out[0]["next_loss"][2]
    assert abs(r["next_loss"] - world2_next) < 1e-5, (r["next_loss"], world2_next)
