"""The ``deepshard`` command names the first cause of a failure, not its consequence (issue 43).

Under ``--max_restarts=1`` a rank SIGKILLed in each attempt ends the job once the restart is used up.
Its peer, waiting in a gloo barrier, then fails too ("Connection closed by peer") a moment later; when
both are dead by the time torch's agent looks (it polls every 0.1 s), the agent reports the lower
local rank, the survivor, and the error line named the gloo error.  The test makes that race certain:
in the second attempt it stops the launcher (SIGSTOP) before the kill and lets it go on once both
workers are dead.  The line must name the killed rank and its signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepshard.core.mesh import free_port

pytestmark = pytest.mark.slow

SCRIPT = """
import os, signal, sys, time
from pathlib import Path
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from deepshard.launch import Heartbeat

@record
def main():
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    Heartbeat.from_env(rank).mark("forward", 1)
    dist.barrier()
    Path(f"ready-{attempt}-{rank}").write_text(str(os.getpid()))
    if rank == 1:
        while attempt == 1 and not Path("go").exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0: its peer is gone

main()
"""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _wait(what, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (got := what()):
            return got
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_after_a_restart_the_error_line_names_the_killed_rank_not_its_peers_gloo_error(tmp_path):
    (tmp_path / "die.py").write_text(SCRIPT)
    (tmp_path / "beats").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update(OMP_NUM_THREADS="1", DEEPSHARD_HEARTBEAT_DIR=str(tmp_path / "beats"))
    launcher = subprocess.Popen([sys.executable, "-m", "deepshard.launch.cli", "--max_restarts=1",
                                 f"--master_port={free_port()}", "die.py"], cwd=tmp_path, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pids = _wait(lambda: all((tmp_path / f"ready-1-{r}").exists() for r in (0, 1)) and
                     [int((tmp_path / f"ready-1-{r}").read_text()) for r in (0, 1)], timeout=120)
        os.kill(launcher.pid, signal.SIGSTOP)  # the agent looks only once both workers are dead
        try:
            (tmp_path / "go").write_text("")
            _wait(lambda: all(_state(p) in ("Z", "gone") for p in pids))
        finally:
            os.kill(launcher.pid, signal.SIGCONT)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 128 + signal.SIGKILL, err[-3000:]
    assert "restarting the workers (restart 1 of 1)" in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 on ") and " died with SIGKILL" in last, err[-3000:]
