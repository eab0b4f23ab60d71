"""Mounting small tmpfs file systems for tests of full disks (root only), shared by the fixtures."""

import subprocess

import pytest


def tmpfs_mounter(new_dir):
    """``mount(size)`` mounts a fresh tmpfs of that size on ``new_dir()``; the generator's end unmounts
    them all (the test is skipped where mounting is not permitted: tests of full disks need root)."""
    mounts = []

    def mount(size: str):
        mnt = new_dir()
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True,
                             text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
        mounts.append(mnt)
        return mnt

    yield mount
    for mnt in mounts:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
