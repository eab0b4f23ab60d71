"""The ``deepshard`` command names a worker the kernel killed for memory as such (issue 43), as the app's
own launcher does (tests/faults/test_oom_line.py): a plain two-rank script under ``deepshard`` inside a
cgroup v1 memory limit, whose rank 1 allocates until the group's OOM killer takes it.  The workers' raised
``oom_score_adj`` makes the killer take a worker, never the agent, which lives to print the line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from bench.bench_infinity import cgroup_available, memory_cgroup

pytestmark = pytest.mark.slow

LIMIT = 768 * 2**20
GREEDY = """
import os, time
import torch.distributed as dist
from deepshard.launch import Heartbeat
dist.init_process_group("gloo")
beat = Heartbeat.from_env(dist.get_rank())
beat.mark("forward", 3)
dist.barrier()
if dist.get_rank() == 1:
    hoard = []
    while True:
        hoard.append(bytearray(32 << 20))  # zero-filled: every page touched
time.sleep(60)
"""


@pytest.mark.skipif(not cgroup_available(), reason="needs root and the cgroup v1 memory controller")
def test_deepshard_names_a_worker_killed_for_memory(tmp_path):
    (tmp_path / "greedy.py").write_text(GREEDY)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    with memory_cgroup(LIMIT) as group:
        proc = subprocess.Popen([sys.executable, "-m", "deepshard.launch.cli", "--num_gpus", "2", "greedy.py"],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True,
                                preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        kills = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())["oom_kill"]
    assert int(kills) >= 1, (kills, err[:3000])  # the kernel's OOM killer did it
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert last.startswith("error: rank 1 on ") and " was killed for memory at step 3 (forward)" in last, err[-3000:]
    assert last.endswith("(memory limit 0.75 GiB)"), last
