"""Workers die with their launcher: a SIGKILL of the launcher process alone (an OOM killer's, a
scheduler's ``kill -9`` of the job leader) leaves no worker of that run alive a few seconds later,
for the ``deepshard`` command's elastic agent and for ``launch_local`` (the app's own launch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepshard.core.checkpoint.owners import write_owner
from deepshard.launch.heartbeat import remove_stale_beat_dirs

pytestmark = pytest.mark.slow

DEEPSHARD = [sys.executable, "-m", "deepshard.launch.cli"]

# a training loop that never ends: each rank writes its pid, then all-reduces forever (mid-step)
LOOP = """
import os, sys, time
from pathlib import Path
import torch, torch.distributed as dist


def loop(pid_dir):
    dist.init_process_group("gloo")
    Path(pid_dir, f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
    t = torch.ones(1)
    while True:
        dist.all_reduce(t)
        time.sleep(0.01)


if __name__ == "__main__":
    loop(sys.argv[-1])
"""

LAUNCH_LOCAL = """
import sys
sys.path.insert(0, {here!r})
from deepshard.launch import launch_local
import loop_worker

if __name__ == "__main__":
    launch_local(loop_worker.loop, 2, sys.argv[1])
"""


def _start_time(pid: int) -> str | None:
    """The process's start time (its identity with its pid), None when it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _workers(pid_dir: Path, n: int, launcher: subprocess.Popen, timeout: float = 90) -> dict[int, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(pid_dir.glob("rank*.pid"))
        if len(files) == n and all(f.read_text() for f in files):
            pids = [int(f.read_text()) for f in files]
            return {p: s for p in pids if (s := _start_time(p)) is not None}
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        time.sleep(0.1)
    raise AssertionError(f"the workers did not start in {timeout} s")


def _kill_launcher_and_wait(launcher: subprocess.Popen, workers: dict[int, str]) -> float:
    """SIGKILL the launcher alone; seconds until its last worker is gone (or a failure after 15 s)."""
    time.sleep(0.2)  # mid-step: the ranks are all-reducing (each wrote its pid file inside the loop)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    start = time.monotonic()
    while time.monotonic() - start < 15:
        alive = [p for p, s in workers.items() if _start_time(p) == s]
        if not alive:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"workers {alive} still alive 15 s after their launcher's SIGKILL")


def _run(argv: list[str], cwd: Path, pid_dir: Path, env: dict[str, str] | None = None) -> int:
    """Start the launcher, SIGKILL it once its workers run; its pid."""
    launcher = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env={**os.environ, **(env or {})})
    workers: dict[int, str] = {}
    try:
        workers = _workers(pid_dir, 2, launcher)
        took = _kill_launcher_and_wait(launcher, workers)
        print(f"launcher SIGKILL -> no worker left: {took:.2f} s")
        assert took < 5
    finally:
        for pid, start in workers.items():  # what the test started, it stops
            if _start_time(pid) == start:
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(launcher.pid, signal.SIGKILL)  # the forkserver, the resource tracker
        except ProcessLookupError:
            pass
        launcher.wait()
        if launcher.stderr:
            launcher.stderr.close()
    return launcher.pid


def test_the_deepshard_commands_workers_die_with_it(tmp_path):
    """Also what the killed agent leaves in the temp dir (here TMPDIR=tmp_path/tmp): its heartbeat
    directory, which the next agent's start removes, and only it (not a live agent's)."""
    (tmp_path / "loop.py").write_text(LOOP)
    (tmp_path / "pids").mkdir()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    pid = _run([*DEEPSHARD, "--num_gpus=2", "loop.py", str(tmp_path / "pids")], tmp_path, tmp_path / "pids",
               env={"TMPDIR": str(tmp)})
    (left,) = tmp.glob("deepshard-*-heartbeat-*")
    assert json.loads((left / ".owner.json").read_text())["pid"] == pid  # the SIGKILLed agent's
    live = tmp / "deepshard-live-heartbeat-0"  # one of this process's: it runs
    live.mkdir()
    write_owner(live)
    assert remove_stale_beat_dirs(str(tmp)) == [left] and not left.exists() and live.is_dir()


def test_launch_locals_workers_die_with_it(tmp_path):
    (tmp_path / "loop_worker.py").write_text(LOOP)
    (tmp_path / "launch.py").write_text(LAUNCH_LOCAL.format(here=str(tmp_path)))
    (tmp_path / "pids").mkdir()
    _run([sys.executable, "launch.py", str(tmp_path / "pids")], tmp_path, tmp_path / "pids")
