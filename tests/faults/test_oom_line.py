"""A worker the kernel kills for memory is named as such, with the estimate and the limit (issue 43): the
app at world 2 inside a cgroup v1 memory limit, its last rank told (``DEEPSHARD_TEST_FAULT=oom@2``) to
allocate until the group's OOM killer takes it.  The workers' raised ``oom_score_adj`` makes the
killer take that worker, never the launcher, which lives to print the one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from bench.bench_infinity import cgroup_available, memory_cgroup
from tests.faults.run_harness import MAIN, ROOT, TINY

pytestmark = pytest.mark.slow

LIMIT = 2 * 2**30


@pytest.mark.skipif(not cgroup_available(), reason="needs root and the cgroup v1 memory controller")
def test_a_worker_killed_for_memory_is_reported_with_its_step_estimate_and_limit(tmp_path):
    run_dir = tmp_path / "run"
    with memory_cgroup(LIMIT) as group:
        out = subprocess.run([sys.executable, str(MAIN), *TINY, "train.max_steps=4", f"hydra.run.dir={run_dir}"],
                             capture_output=True, text=True, timeout=300, cwd=ROOT,
                             env={**os.environ, "DEEPSHARD_TEST_FAULT": "oom@2"},
                             preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
        kills = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())["oom_kill"]
    assert not group.exists()  # the group is gone with its last process
    lines = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert out.returncode == 1, out.stderr[-3000:]
    assert int(kills) >= 1, kills  # the kernel's OOM killer did it, not a test's kill
    assert len(lines) == 1, out.stderr[-3000:]
    got = re.fullmatch(r"error: rank 1 was killed for memory at step 2 \(forward\) "
                       r"\(estimate (\d+\.\d\d) GiB, limit 2\.00 GiB; try (.+)\)", lines[0])
    assert got, lines[0]
    assert 0 < float(got.group(1)) < 2.0 and "+zero=stage3" in got.group(2), lines[0]
    assert "Traceback" not in out.stderr
