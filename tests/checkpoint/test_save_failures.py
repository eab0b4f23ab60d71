"""At world 2: a full checkpoint dir is refused up front ("needs X MB, Y MB free") or, when it fills
during the write, fails with one line on every rank; either way the partial temp dir is removed and
the older checkpoint is intact.  All ranks agree on one run dir, and a checkpoint dir that one rank
cannot see is named before training."""

from __future__ import annotations

import pytest

from deepshard.launch.local import launch_local
from tests.checkpoint.failure_harness import disk_worker


@pytest.fixture
def small_tmpfs(mount_tmpfs):
    """A 2 MB tmpfs (tests/conftest.py's mount_tmpfs)."""
    return mount_tmpfs("2m")


@pytest.mark.slow
def test_full_disk_and_shared_directories(tmp_path, small_tmpfs):
    results = launch_local(disk_worker, 2, str(tmp_path / "scratch"), str(small_tmpfs))
    for r in results:
        assert r["run_dir"] == str(tmp_path / "scratch" / "hydra-dir-of-rank0")  # rank 0's, on both
        assert r["shared"] is None
        assert r["node_local"] == (f"checkpoint.dir={tmp_path / 'scratch' / 'local-disk-of-rank0'} is not visible "
                                   f"from rank 1 (node-local disk?): use a shared filesystem that every node mounts "
                                   f"at the same path")
        assert "saving step 2 failed: needs 1." in r["no_space"] and " MB free" in r["no_space"], r["no_space"]
        assert r["after_no_space"] == {"steps": [1], "temp": []}
        assert "saving step 3 failed: the disk is full" in r["enospc"], r["enospc"]
        assert "removed the partial step-00000003.tmp-" in r["enospc"] and "\n" not in r["enospc"], r["enospc"]
        assert r["after_enospc"] == {"steps": [1], "temp": []}
        assert r["first_intact"] is True
    assert results[0]["enospc"] == results[1]["enospc"]  # one agreed message
