"""Shared test settings (one thread per process keeps multi-rank tests honest on 2 cores) and fixtures."""

import os
import subprocess

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs("2m")``: a fresh tmpfs of that size under tmp_path, unmounted afterwards (the
    test is skipped where mounting is not permitted: tests of full disks need root)."""
    mounts = []

    def mount(size: str):
        mnt = tmp_path / f"tmpfs-{len(mounts)}"
        mnt.mkdir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                             text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        mounts.append(mnt)
        return mnt

    yield mount
    for mnt in mounts:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
