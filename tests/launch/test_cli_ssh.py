"""The ``deepshard`` command over real ssh to a real sshd (OpenSSH, started by the test on the
loopback): a hostfile of ``127.0.0.1 slots=1`` and ``127.0.0.2 slots=1`` trains a DeepSpeed script
(deepshard.compat, ZeRO-3, fp32) to the losses of a one-node world-2 run, bit for bit, with
``.deepspeed_env`` forwarded over ssh (variables whose names are shell syntax are not, nor run); and a
SIGKILL of the launcher leaves no worker on either "host".
Skips, naming the reason, only where sshd is not installed (the README's setup installs it)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from deepshard.core.mesh import free_port
from tests.launch.compat_runs import DEEPSHARD, final_losses, run_loop
from tests.launch.loopback_sshd import loopback_sshd
from tests.launch.test_orphans import LOOP, _start_time, _workers

pytestmark = pytest.mark.slow

HOSTFILE = "# two loopback 'hosts', one worker each\n127.0.0.1 slots=1\n127.0.0.2 slots=1\n"


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    with loopback_sshd(tmp_path_factory.mktemp("sshd")) as env:
        yield env


def test_two_hosts_over_sshd_train_zero3_as_one_node(tmp_path, sshd, one_node_losses):
    work = tmp_path / "job"
    work.mkdir()
    (work / "hosts").write_text(HOSTFILE)
    (work / ".deepspeed_env").write_text("FROM_ENV_FILE=over real ssh\n")
    # forwarded prefixes whose names are shell syntax (issue 45 item 4): named once, never run on a node
    hostile = {f"PYTHON_X$(touch {work}/pwn)": "1", "PYTHON.CACHE": "1"}
    code, err, rows = run_loop(["--hostfile=hosts", f"--master_port={free_port()}"], work, env={**sshd, **hostile})
    assert code == 0, err[-3000:]
    assert not (work / "pwn").exists()
    assert err.count("warning: not forwarded to the nodes") == 1 and "'PYTHON.CACHE'" in err, err[-3000:]
    on = {r["rank"]: tuple(r["server"]) for r in rows}  # which rank a host runs follows the c10d rendezvous
    assert sorted(on) == [0, 1] and sorted(on.values()) == [("127.0.0.1",), ("127.0.0.2",)], on
    assert all(r["env_file"] == "over real ssh" for r in rows)
    assert final_losses(rows) == one_node_losses  # fp32, ZeRO-3: bit for bit


def test_a_sigkilled_launcher_leaves_no_worker_on_the_hosts(tmp_path, sshd):
    (tmp_path / "loop.py").write_text(LOOP)
    (tmp_path / "hosts").write_text(HOSTFILE)
    pids = tmp_path / "pids"
    pids.mkdir()
    launcher = subprocess.Popen([*DEEPSHARD, "--hostfile=hosts", f"--master_port={free_port()}", "loop.py", str(pids)],
                                cwd=tmp_path, env={**os.environ, **sshd}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    workers: dict[int, str] = {}
    try:
        workers = _workers(pids, 2, launcher)
        time.sleep(0.2)  # mid-step (the workers wrote their pid files inside the loop)
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        start = time.monotonic()
        while any(_start_time(p) == s for p, s in workers.items()) and time.monotonic() - start < 15:
            time.sleep(0.05)
        took = time.monotonic() - start
        print(f"launcher SIGKILL -> no worker left on either host: {took:.2f} s")
        assert took < 5, [p for p, s in workers.items() if _start_time(p) == s]
    finally:
        for pid, start_time in workers.items():
            if _start_time(pid) == start_time:
                os.kill(pid, signal.SIGKILL)
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait()
        if launcher.stderr:
            launcher.stderr.close()

