"""A launch leaves nothing in the temp dir: torch's elastic agent makes a ``torchelastic_*`` directory
per launch for the workers' error files and never removes it (2,217 of them had piled up in this host's
/tmp); ``launch_local`` gives it one of its own and removes it when the job ends, failed or not."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two world-2 launches in a fresh interpreter

SCRIPT = """
import os
from deepshard.launch.local import JobFailed, launch_local
print(launch_local(os.getpid, 2))
try:
    launch_local(int, 2, "not a number")
except JobFailed as err:
    print("failed:", err)
"""


def test_a_launch_leaves_no_elastic_scratch_whether_it_succeeds_or_fails():
    # a short TMPDIR of its own: the forkserver's socket lives under it (AF_UNIX paths end at 107 bytes)
    scratch = Path(tempfile.mkdtemp(prefix="scratch-", dir="/tmp"))
    try:
        done = subprocess.run([sys.executable, "-c", SCRIPT], env={**os.environ, "TMPDIR": str(scratch)},
                              capture_output=True, text=True, timeout=180)
        left = sorted(p.name for p in scratch.iterdir() if p.name.startswith(("torchelastic_", "deepshard-elastic-")))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "failed: rank " in done.stdout and "ValueError" in done.stdout, done.stdout  # the error file was read
    assert left == []
