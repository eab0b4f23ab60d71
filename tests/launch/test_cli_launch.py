"""The deepshard command with real processes: one node (a script, --module, --no_python,
--no_local_rank, .deepspeed_env), a dead rank, two nodes by --no_ssh on two shells, and a hostfile of
two loopback hosts over ssh (a stand-in ``ssh`` on PATH that runs the remote line here; the real
sshd is test_cli_ssh.py's), and ``--launcher slurm`` under a stand-in ``srun``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepshard.core.mesh import free_port

pytestmark = pytest.mark.slow

DEEPSHARD = [sys.executable, "-m", "deepshard.launch.cli"]

# each rank prints one JSON line: what the launcher gave it, and a collective over the whole world
SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FROM_ENV_FILE")
row = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}, "sum": t.item()}
os.write(1, f"RESULT {json.dumps(row)}\\n".encode())  # one write: the ranks share the pipe
dist.destroy_process_group()
"""

DIE = """
import os, signal, time
import torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    open("killed_at", "w").write(str(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
"""

HANG = """
import os, time
import torch.distributed as dist
from deepshard.launch import Heartbeat
dist.init_process_group("gloo")
rank = dist.get_rank()
beat = Heartbeat.from_env(rank)  # progress, for the launcher's watchdog
for step in range(1, 5):
    beat.mark("forward", step)
    if rank == 1 and step == 3:
        time.sleep(600)  # hung in forward (its beat thread still beats, as a hung rank's does)
    beat.mark("backward", step)  # the healthy rank gets this far, then waits in the barrier
    dist.barrier()
"""

FAKE_SSH = """#!/bin/sh
# ssh HOST LINE, run here: options skipped, the host recorded
while [ $# -gt 0 ]; do case "$1" in -o|-p) shift 2;; -*) shift;; *) break;; esac; done
echo "$1" >> "$FAKE_SSH_LOG"
shift
exec sh -c "$*"
"""


def launch(argv, cwd, *, env=None, timeout=120):
    """Run a command in its own session; whatever it started is stopped when this returns."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    proc = subprocess.Popen(argv, cwd=cwd, env={**base, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the agent stops its workers (their own sessions) on SIGTERM
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def results(out: str) -> list[dict]:
    rows = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("RESULT ")]
    return sorted(rows, key=lambda r: int(r["env"]["RANK"]))


@pytest.fixture
def job(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "train.py").write_text(SCRIPT)
    return tmp_path


def test_one_node_script_module_and_env_file(job, one_node_cifar):
    code, out, err = one_node_cifar  # a script with its own arguments, and .deepspeed_env
    assert code == 0, err[-3000:]
    rows = results(out)
    assert [r["argv"] for r in rows] == [["--local_rank=0", *CIFAR_ARGS], ["--local_rank=1", *CIFAR_ARGS]]
    assert [(r["env"]["RANK"], r["env"]["LOCAL_RANK"], r["env"]["WORLD_SIZE"]) for r in rows] == [
        ("0", "0", "2"), ("1", "1", "2")]
    assert all(r["env"]["MASTER_ADDR"] and r["env"]["MASTER_PORT"].isdigit() for r in rows)
    assert all(r["env"]["FROM_ENV_FILE"] == "a b=c" and r["sum"] == 3.0 for r in rows)

    code, out, err = launch([*DEEPSHARD, "--num_accelerators=3", "--module", "--no_local_rank", "pkg.train", "x"], job)
    assert code == 0, err
    assert [r["argv"] for r in results(out)] == [["x"]] * 3 and results(out)[0]["sum"] == 6.0


def test_no_python_executable(job):
    (job / "run.sh").write_text('#!/bin/sh\necho "EXE $RANK/$WORLD_SIZE $*"\n')
    (job / "run.sh").chmod(0o755)
    code, out, err = launch([*DEEPSHARD, "--no_python", "./run.sh", "a"], job)
    assert code == 0, err
    assert sorted(line for line in out.splitlines() if line.startswith("EXE")) == [
        "EXE 0/2 --local_rank=0 a", "EXE 1/2 --local_rank=1 a"]


def test_dead_rank_ends_the_job_naming_host_rank_and_signal(job):
    (job / "die.py").write_text(DIE)
    code, _, err = launch([*DEEPSHARD, "die.py"], job)
    ended = time.time()
    assert code == 128 + signal.SIGKILL, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 on ") and last.endswith(" died with SIGKILL"), err
    took = ended - float((job / "killed_at").read_text())
    print(f"dead rank -> job's end: {took:.1f} s")
    assert took < 15


def test_hung_rank_that_reports_progress_is_named(job):
    (job / "hang.py").write_text(HANG)
    start = time.time()
    code, _, err = launch([*DEEPSHARD, "--hang_s=3", "hang.py"], job)
    assert code == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 on ") and " has made no progress since step 3 (forward) for " in last, err
    assert last.endswith("; the workers were stopped") and time.time() - start < 60


def test_two_nodes_no_ssh_on_two_shells(job):
    port = free_port()
    common = ["--no_ssh", "--num_nodes=2", "--num_gpus=1", "--master_addr=127.0.0.1", f"--master_port={port}"]
    procs = [subprocess.Popen([*DEEPSHARD, *common, f"--node_rank={r}", "script.py"], cwd=job, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=20)
    assert [p.returncode for p in procs] == [0, 0], [o[1] for o in outs]
    rows = results(outs[0][0] + outs[1][0])
    assert [(r["env"]["RANK"], r["env"]["LOCAL_RANK"], r["env"]["WORLD_SIZE"]) for r in rows] == [
        ("0", "0", "2"), ("1", "0", "2")]
    assert all(r["sum"] == 3.0 and r["argv"] == [f"--local_rank={r['env']['LOCAL_RANK']}"] for r in rows)


@pytest.fixture
def fake_ssh(tmp_path) -> dict[str, str]:
    """The environment of a launcher whose ``ssh`` runs the remote line on this host (and logs the host)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SSH_LOG": str(tmp_path / "ssh.log")}


def test_hostfile_of_two_hosts_over_ssh_with_include(job, tmp_path, fake_ssh):
    (job / "hosts").write_text("# two loopback 'nodes'\n127.0.0.1 slots=2\n127.0.0.2 slots=2\n")
    (job / ".deepspeed_env").write_text("FROM_ENV_FILE=over ssh\n")
    env = fake_ssh
    code, out, err = launch([*DEEPSHARD, "--hostfile=hosts", "--include=127.0.0.1:0@127.0.0.2:0",
                             f"--master_port={free_port()}", "script.py"], job, env=env)
    assert code == 0, err
    rows = results(out)
    assert [(r["env"]["RANK"], r["env"]["LOCAL_RANK"], r["env"]["WORLD_SIZE"]) for r in rows] == [
        ("0", "0", "2"), ("1", "0", "2")]
    assert all(r["sum"] == 3.0 and r["env"]["FROM_ENV_FILE"] == "over ssh" for r in rows)
    reached = (tmp_path / "ssh.log").read_text().split()
    assert sorted(set(reached)) == ["127.0.0.1", "127.0.0.2"] and len(reached) == 4  # the check, then the job


def test_dead_rank_on_the_second_node_is_named_over_ssh(job, fake_ssh):
    (job / "die.py").write_text(DIE)
    (job / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    code, _, err = launch([*DEEPSHARD, "-H", "hosts", f"--master_port={free_port()}", "--no_ssh_check", "die.py"], job,
                          env=fake_ssh)
    assert code == 128 + signal.SIGKILL, err
    assert err.strip().splitlines()[-1] == "error: rank 1 on 127.0.0.2 (node 1) died with SIGKILL", err


def test_unreachable_host_is_named_before_anything_starts(job, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text('#!/bin/sh\necho "ssh: connect to host: No route to host" >&2\nexit 255\n')
    (bin_dir / "ssh").chmod(0o755)
    (job / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    code, out, err = launch([*DEEPSHARD, "-H", "hosts", "script.py"], job,
                            env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert code == 2 and err.count("\n") == 1 and not out
    assert err.startswith("error: host 127.0.0.1 cannot be reached over ssh: ssh: connect to host: No route to host")


# DeepSpeedExamples' CIFAR script on deepshard.compat, which also prints what SCRIPT prints (the launcher's
# variables and a collective over the world, before the script joins the group): one launch serves
# test_one_node_script_module_and_env_file and test_a_deepspeed_script_on_deepshard_compat (a world-2
# launch costs ~10 s of CPU here, its CIFAR epoch ~1 s)
DS_SCRIPT = """
import json, math, os, sys
sys.path.insert(0, {harness!r})
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
from tests.compat.ds_script_harness import add_argument, cifar_main  # DeepSpeedExamples' CIFAR script on deepshard.compat
args = add_argument(sys.argv[1:])  # argparse with --local_rank and DeepSpeed's config arguments
assert args.local_rank == int(os.environ["LOCAL_RANK"]), (args.local_rank, os.environ["LOCAL_RANK"])
losses = cifar_main(args)  # deepspeed.init_distributed() joins the group above
assert losses and all(math.isfinite(x) for x in losses)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "FROM_ENV_FILE")
row = dict(argv=sys.argv[1:], env={{k: os.environ.get(k) for k in keys}}, sum=t.item(), steps=len(losses))
os.write(1, f"RESULT {{json.dumps(row)}}\\n".encode())
"""
CIFAR_ARGS = ["--epochs", "1", "--dtype", "fp32", "--stage", "3"]


@pytest.fixture(scope="module")
def one_node_cifar(tmp_path_factory) -> tuple[int, str, str]:
    """``deepshard --num_gpus 2 cifar.py ARGS`` with a ``.deepspeed_env``: (exit code, stdout, stderr)."""
    work = tmp_path_factory.mktemp("one_node_cifar")
    harness = str(Path(__file__).resolve().parents[2])  # the repo root: tests.* by package path
    (work / "cifar.py").write_text(DS_SCRIPT.format(harness=harness))
    (work / ".deepspeed_env").write_text("# forwarded to every worker\nFROM_ENV_FILE=a b=c\n")
    return launch([*DEEPSHARD, "--num_gpus", "2", "cifar.py", *CIFAR_ARGS], work)


def test_a_deepspeed_script_on_deepshard_compat(one_node_cifar):
    code, out, err = one_node_cifar
    assert code == 0, err[-3000:]
    rows = results(out)
    assert [r["env"]["RANK"] for r in rows] == ["0", "1"] and rows[0]["steps"] == rows[1]["steps"] > 0
    assert rows[1]["argv"][0] == "--local_rank=1"


FAKE_SRUN = """#!{python}
# srun inside an allocation, stood in: one task per node of --nodelist, each with its SLURM_NODEID
import os, subprocess, sys
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
open(os.environ["FAKE_SRUN_LOG"], "w").write(" ".join(sys.argv[1:]))
tasks = [subprocess.Popen(args, env={{**os.environ, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i)}})
         for i, _ in enumerate(opts["nodelist"].split(","))]
sys.exit(max(t.wait() for t in tasks))
"""


def test_launcher_slurm_runs_one_agent_per_node_under_srun(job, tmp_path):
    """``--launcher slurm`` end to end but for Slurm itself: a stand-in ``srun`` on PATH starts the
    node command once per node with ``SLURM_NODEID``; each node's agent finds its node rank there."""
    bin_dir = tmp_path / "srun_bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "srun").chmod(0o755)
    (job / "hosts").write_text("127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_SRUN_LOG": str(tmp_path / "srun.log")}
    code, out, err = launch([*DEEPSHARD, "-H", "hosts", "--launcher=slurm", f"--master_port={free_port()}", "script.py"],
                            job, env=env)
    assert code == 0, err[-3000:]
    rows = results(out)
    assert [(r["env"]["RANK"], r["env"]["WORLD_SIZE"]) for r in rows] == [("0", "2"), ("1", "2")]
    assert all(r["sum"] == 3.0 for r in rows)
    assert (tmp_path / "srun.log").read_text().startswith("--nodes=2 --ntasks=2 --ntasks-per-node=1 "
                                                          "--nodelist=127.0.0.1,127.0.0.2 --export=ALL ")
