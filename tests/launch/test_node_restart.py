"""A node that leaves (issue 43): two torchrun agents as two nodes on loopback (c10d rendezvous,
``--max-restarts=1``), one worker each, train the app (ZeRO-3, a save every 4 steps of 8).

At step 6 node B dies: its agent and its worker are SIGKILLed together (as a host that goes away; a
worker of torchrun's agent outlives a SIGKILLed agent, in a session of its own).  Who relaunches what: node A's agent sees its own worker fail (its gloo peer is
gone) and restarts its workers into a new rendezvous round, where it waits for a second node; nothing
in torch restarts a dead agent, so the harness, as a cluster manager would, starts node B's command
again at once.  The round completes, both workers resume from the last checkpoint (step 4) and the
run ends with the uninterrupted run's losses, bit for bit (fp32).  The time from the kill to the first
step trained again is printed.

The same launch checks the torchrun path of the job lock: global rank 0 holds the run dir, so a plain
app job started on it is refused naming rank 0's pid, and the restarted rank 0 (a new process of the
same run id) takes the directory again.

The same through ``deepshard --hostfile`` over the loopback sshd (two "hosts", 127.0.0.1 and 127.0.0.2, one
worker each, ``--max_restarts=1``): node 1's agent and worker are SIGKILLed at step 6.  Who relaunches
what: node 0's agent restarts its own worker into a new rendezvous round (node 0 hosts the rendezvous);
the ``deepshard`` launcher, which started node 1 over ssh, sees that session end without an ``error:``
line of its own and starts node 1's command again over ssh (``launch/remote.py``, the cluster manager's
part under torchrun).  The job resumes from step 4 and ends with the clean run's losses, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deepshard.core.mesh import free_port
from tests.app_runner import run_main
from tests.launch.loopback_sshd import loopback_sshd
from tests.launch.test_cli_restart import MAIN, RUN, losses

pytestmark = pytest.mark.slow


def _node(run_dir: Path, port: int, *, host: bool, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--max-restarts=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=node-restart",
           f"--rdzv-conf=is_host={int(host)}", "--monitor-interval=0.1",
           str(MAIN), *RUN, f"hydra.run.dir={run_dir}"]
    return subprocess.Popen(cmd, cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


class _Lines:
    """A node's output, read in the background with the time each line came."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend((time.monotonic(), x) for x in proc.stdout),
                                       daemon=True)
        self.thread.start()

    def text(self) -> str:
        return "".join(x for _, x in self.lines)

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, str] | None:
        return next(((t, x) for t, x in list(self.lines) if t >= after and re.search(pattern, x)), None)


def _wait(what, timeout: float = 180):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _beat(beat_dir: Path, rank: int) -> dict | None:
    try:
        return json.loads((beat_dir / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def test_a_node_killed_mid_run_rejoins_and_the_job_ends_as_the_clean_run(tmp_path, whole_app_losses):
    run_dir, beat_dir = tmp_path / "run", tmp_path / "beats"
    beat_dir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DEEPSHARD_HEARTBEAT_DIR": str(beat_dir),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # each round's workers get a fresh store (see launch.agent)
    port = free_port()
    procs: list[subprocess.Popen] = []
    try:
        node_a = _node(run_dir, port, host=True, env=env)
        procs.append(node_a)
        node_b = _node(run_dir, port, host=False, env=env)
        procs.append(node_b)
        out_a = _Lines(node_a)
        _Lines(node_b)
        _wait(lambda: out_a.first(r"step\s+2\s+loss"))

        # the torchrun path of the lock: rank 0 (node A's worker) holds the run dir; both workers are
        # stopped meanwhile (a step takes a fraction of a second: the job would end before the check)
        workers = [_beat(beat_dir, r)["pid"] for r in (0, 1)]
        for pid in workers:
            os.kill(pid, signal.SIGSTOP)
        try:
            second = run_main([*RUN, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120)  # refused: no signal
        finally:
            for pid in workers:
                os.kill(pid, signal.SIGCONT)
        rank0 = workers[0]
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.strip().splitlines()[-1].startswith(
            f"error: hydra.run.dir={run_dir} is in use by another deepshard job (pid {rank0} "), second.stderr[-3000:]

        victim = _wait(lambda: (b := _beat(beat_dir, 1)) and b["step"] >= 6 and b["phase"] != "startup" and b)
        os.killpg(node_b.pid, signal.SIGKILL)  # node B goes away: its agent and its worker (torch's agent
        os.kill(victim["pid"], signal.SIGKILL)  # starts each worker in a session of its own)
        killed_at = time.monotonic()
        node_b.wait()
        node_b = _node(run_dir, port, host=False, env=env)  # the cluster manager starts node B again
        procs.append(node_b)
        out_b = _Lines(node_b)
        resumed = _wait(lambda: out_a.first(r"resumed from", after=killed_at), timeout=240)
        back = _wait(lambda: out_a.first(r"step\s+\d+\s+loss", after=resumed[0]), timeout=60)
        assert node_a.wait(timeout=240) == 0, out_a.text()[-3000:]
        assert node_b.wait(timeout=60) == 0, out_b.text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    print(f"node B killed at step {victim['step']}; training again {back[0] - killed_at:.1f} s after the kill")
    assert "step-00000004 at step 4" in resumed[1], resumed  # resumed from the last verified checkpoint
    assert re.search(r"step\s+5\s+loss", back[1]), back  # the first step after the kill is the one after it
    cut = losses(run_dir)
    assert sorted(cut) == list(range(1, 9))
    assert [cut[s] for s in range(1, 9)] == [whole_app_losses[s] for s in range(1, 9)]  # fp32: bit for bit
    assert not (run_dir / ".deepshard.lock").exists()  # the restarted rank 0 held it and released it


def _node_of(pid: int) -> str:
    """The ``--node_rank=N`` of the agent that started worker ``pid`` (its parent: the guard execs)."""
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return next((a for a in Path(f"/proc/{ppid}/cmdline").read_text().split("\0") if a.startswith("--node_rank=")),
                "?")


def test_a_node_killed_under_deepshard_hostfile_is_relaunched_and_ends_as_the_clean_run(tmp_path, whole_app_losses):
    run_dir, beat_dir = tmp_path / "run", tmp_path / "beats"
    beat_dir.mkdir()
    (tmp_path / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    with loopback_sshd(tmp_path / "sshd") as sshd:
        env = {**os.environ, **sshd, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "DEEPSHARD_HEARTBEAT_DIR": str(beat_dir)}  # forwarded to both nodes (the DEEPSHARD prefix)
        launcher = subprocess.Popen([sys.executable, "-m", "deepshard.launch.cli", "--hostfile=hosts",
                                     "--max_restarts=1", f"--master_port={free_port()}", str(MAIN), *RUN,
                                     f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out = _Lines(launcher)
            # node 1's worker: the rendezvous, not the hostfile, decides its global rank
            victim = _wait(lambda: next((b for r in (0, 1) if (b := _beat(beat_dir, r)) and b["step"] >= 6
                                         and b["phase"] != "startup" and _node_of(b["pid"]) == "--node_rank=1"), None))
            agent = int(Path(f"/proc/{victim['pid']}/stat").read_text().rsplit(")", 1)[1].split()[1])
            os.kill(agent, signal.SIGKILL)  # node 1 goes away: its agent and its worker
            os.kill(victim["pid"], signal.SIGKILL)
            killed_at = time.monotonic()
            resumed = _wait(lambda: out.first(r"resumed from", after=killed_at), timeout=120)
            back = _wait(lambda: out.first(r"step\s+\d+\s+loss", after=resumed[0]), timeout=60)
            assert launcher.wait(timeout=120) == 0, out.text()[-3000:]
            out.thread.join(timeout=10)
        finally:
            if launcher.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    print(f"node 1 killed at step {victim['step']}; training again {back[0] - killed_at:.1f} s after the kill")
    text = out.text()
    assert "deepshard: node 1 (127.0.0.2) ended without a word" in text and "(node restart 1 of 1)" in text, text[-3000:]
    assert "restarting the workers (restart 1 of 1)" in text, text[-3000:]  # node 0's agent restarted its worker
    assert "step-00000004 at step 4" in resumed[1], resumed  # resumed from the last verified checkpoint
    assert re.search(r"step\s+5\s+loss", back[1]), back
    cut = losses(run_dir)
    assert sorted(cut) == list(range(1, 9))
    assert [cut[s] for s in range(1, 9)] == [whole_app_losses[s] for s in range(1, 9)]  # fp32: bit for bit
