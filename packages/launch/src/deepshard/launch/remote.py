"""Several nodes: the command each node runs, started over ssh (one per host) or by Slurm's srun.

Every node runs ``python -m deepshard.launch.cli --no_ssh --node_rank=I ...`` with the job's
resources (``--world_info``, DeepSpeed's base64 of ``host -> slots``), rendezvous address and run
id, so each node's elastic agent joins the same c10d rendezvous.  Over ssh the launcher waits for
every node; when one fails it stops the others (closing their ssh sessions ends the remote
commands) and its last line is that node's own ``error:`` line, which names host, rank and cause.
A node started over ssh ends when its session closes (``--end_with_stdin``), and the ssh clients
die with the launcher, so a SIGKILLed launcher leaves no node running.  With ``--max_restarts`` the
launcher also plays the cluster manager's part for a node that goes away (its agent killed, its host
lost): it starts that node's command again, and the job resumes in a new rendezvous round.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from deepshard.launch.deaths import lost_peer
from deepshard.launch.env_file import shell_name
from deepshard.launch.hostfile import Resources
from deepshard.launch.parent_death import guarded

SSH_ARGS_ENV = "PDSH_SSH_ARGS_APPEND"
SUPPORTED = ("pdsh", "ssh", "slurm")  # pdsh (DeepSpeed's default) means: one ssh per host, in parallel
REFUSED = ("openmpi", "mpich", "impi", "mvapich")  # DeepSpeed's MPI launchers start ranks, not agents


def encode_world(resources: Resources) -> str:
    return base64.urlsafe_b64encode(json.dumps(resources).encode()).decode()


def decode_world(text: str) -> Resources:
    try:
        world = json.loads(base64.urlsafe_b64decode(text.encode()))
        return {str(h): [int(s) for s in slots] for h, slots in world.items()}
    except (ValueError, TypeError, AttributeError) as err:
        raise ValueError(f"--world_info={text[:40]}: not a base64 JSON of host -> slots ({err})") from None


def node_command(node_rank: int | str, *, world: str, master_addr: str, master_port: int, run_id: str,
                 launch_flags: Sequence[str], script: str, script_args: Sequence[str],
                 over_ssh: bool = False) -> list[str]:
    """The ``deepshard`` command one node runs (``node_rank`` may be a shell expression for srun);
    ``over_ssh``: the node ends when its ssh session does (its standard input closes)."""
    return [sys.executable, "-u", "-m", "deepshard.launch.cli", "--no_ssh", f"--node_rank={node_rank}",
            f"--world_info={world}", f"--master_addr={master_addr}", f"--master_port={master_port}",
            f"--run_id={run_id}", *(["--end_with_stdin"] if over_ssh else []), *launch_flags, script, *script_args]


def remote_shell_line(command: Sequence[str], *, env: dict[str, str], cwd: str, venv_script: str | None) -> str:
    """What ssh runs on a node: the launcher's directory, its forwarded variables, the command.  The
    line crosses the node's shell: every value is quoted, and a name must already be a shell variable
    name (no quoting makes ``A$(cmd)`` one; :func:`deepshard.launch.env_file.job_env` leaves such out)."""
    bad = [k for k in env if not shell_name(k)]
    if bad:
        raise ValueError(f"{bad[0]!r}: not a shell variable name ([A-Za-z_][A-Za-z0-9_]*): cannot be exported "
                         "on a remote node")
    parts = [f"cd {shlex.quote(cwd)}"]
    if venv_script:
        parts.append(f"source {shlex.quote(venv_script)}")
    parts += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    parts.append("exec " + shlex.join(command))
    return " && ".join(parts)


def split_options(name: str, text: str) -> list[str]:
    """``text`` split as a shell splits words (``-F 'my config'``); a ValueError names ``name``."""
    try:
        return shlex.split(text)
    except ValueError as err:  # "No closing quotation", "No escaped character"
        raise ValueError(f"{name}={text!r}: cannot be split into arguments as a shell would ({err}); "
                         "close its quotes or escape them") from None


def ssh_options() -> list[str]:
    """``PDSH_SSH_ARGS_APPEND``'s options (DeepSpeed's pdsh runner passes that variable's options to
    every ssh: ``-F config``, ``-i key``, ``-l user``); a ValueError names the variable."""
    return split_options(SSH_ARGS_ENV, os.environ.get(SSH_ARGS_ENV, ""))


def ssh_command(host: str, line: str, *, port: int | None, options: Sequence[str] = ()) -> list[str]:
    """``ssh`` to ``host`` running ``line``, with ``PDSH_SSH_ARGS_APPEND``'s options (``--`` ends them:
    a host is never read as one, ``-oProxyCommand=...`` would run a command here)."""
    return ["ssh", "-o", "BatchMode=yes", *options, *ssh_options(), *(["-p", str(port)] if port else []), "--",
            host, line]


def srun_command(resources: Resources, command: Sequence[str], *, launcher_args: str = "", comment: str = "",
                 account: str = "") -> list[str]:
    """Slurm (inside an allocation): one task per node, each running its node's elastic agent; a
    task's node rank is its ``SLURM_NODEID``."""
    hosts = list(resources)
    return ["srun", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(hosts)}", "--export=ALL", *([f"--comment={comment}"] if comment else []),
            *([f"--account={account}"] if account else []), *split_options("--launcher_args", launcher_args),
            *command]


def check_resolvable(hosts: Sequence[str]) -> None:
    """Every host name resolves to an address (ValueError naming the first that does not)."""
    for host in hosts:
        try:
            socket.getaddrinfo(host, None)
        except OSError as err:
            raise ValueError(f"hostfile host {host} cannot be resolved: {err.strerror or err}") from None


def check_reachable(hosts: Sequence[str], *, port: int | None, timeout_s: float = 10.0) -> None:
    """Every host answers ``ssh host true`` in time (ValueError naming the first that does not)."""
    options = ("-o", f"ConnectTimeout={max(1, int(timeout_s))}")
    procs = {h: subprocess.Popen(ssh_command(h, "true", port=port, options=options), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True, start_new_session=True) for h in hosts}
    deadline = time.monotonic() + timeout_s
    failed: list[str] = []
    for host, proc in procs.items():
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            failed.append(f"host {host}: ssh did not answer within {timeout_s:.0f} s")
            continue
        if proc.returncode != 0:
            reason = " ".join((proc.stderr.read() if proc.stderr else "").split()) or f"exit {proc.returncode}"
            failed.append(f"host {host} cannot be reached over ssh: {reason}")
    for proc in procs.values():
        if proc.stderr:
            proc.stderr.close()
    if failed:
        raise ValueError(f"{failed[0]} (--no_ssh_check skips this check)")


def _pump(proc: subprocess.Popen, sink, last: dict[int, str], key: int) -> None:
    """Copy a node's stderr through, keeping its last ``error:`` line."""
    assert proc.stderr is not None
    for line in proc.stderr:
        if line.startswith("error: "):
            last[key] = line.rstrip("\n")[len("error: "):]
        else:
            sink.write(line)
            sink.flush()


def _start_node(host: str, line: str, *, port: int | None, last: dict[int, str], key: int
                ) -> tuple[subprocess.Popen, threading.Thread]:
    """One node's ssh session and the thread that copies its stderr through."""
    # stdin stays open, unwritten: when this launcher ends, the session's end reaches the node
    ssh = ssh_command(host, line, port=port)  # dies with this launcher, even by SIGKILL
    exe, args = guarded(ssh[0], ssh[1:], os.getpid())
    proc = subprocess.Popen([exe, *args], stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    pump = threading.Thread(target=_pump, args=(proc, sys.stderr, last, key), daemon=True)
    pump.start()
    return proc, pump


def run_over_ssh(lines: dict[str, str], *, port: int | None, poll_s: float = 0.2, settle_s: float = 3.0,
                 max_restarts: int = 0) -> tuple[int, str | None]:
    """Start one ssh per host; wait for all.  Returns (exit code, the first failed node's error line).

    A node other than node 0 whose session ends without a word of its own (no ``error:`` line: its
    agent was killed, its host went away) is started again, up to ``max_restarts`` times, as a
    cluster manager would restart it: the surviving agents restart their workers into a new
    rendezvous round and wait there for it (torch's agent never restarts a dead agent).  Node 0
    hosts the rendezvous: its loss ends the job (the others' rendezvous fails, and they say so)."""
    hosts = list(lines)
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    last: dict[int, str] = {}
    restarts = [0] * len(hosts)
    order: list[int] = []  # failed nodes, in the order they were seen to fail
    try:
        for i, host in enumerate(hosts):
            proc, pump = _start_node(host, lines[host], port=port, last=last, key=i)
            procs.append(proc)
            pumps.append(pump)
        settle_until = None
        while True:
            codes = [p.poll() for p in procs]
            for i, code in enumerate(codes):
                if code in (None, 0) or i in order or i == 0 or order or restarts[i] >= max_restarts:
                    continue
                pumps[i].join(timeout=5)  # the session's last line, if it said one
                if i in last:  # its agent's own verdict (restarts used up, a bad script): not a lost node
                    continue
                restarts[i] += 1
                print(f"deepshard: node {i} ({hosts[i]}) ended without a word (ssh exit {code}); starting it "
                      f"again (node restart {restarts[i]} of {max_restarts})", file=sys.stderr, flush=True)
                if procs[i].stdin:
                    procs[i].stdin.close()
                procs[i], pumps[i] = _start_node(hosts[i], lines[hosts[i]], port=port, last=last, key=i)
                codes[i] = None
            order += [i for i, c in enumerate(codes) if c not in (None, 0) and i not in order]
            if all(c == 0 for c in codes) or (order and all(c is not None for c in codes)):
                break
            if order and settle_until is None:  # the cause's peers fail a moment later: let them say so
                settle_until = time.monotonic() + settle_s
            if settle_until is not None and time.monotonic() > settle_until:
                break
            time.sleep(poll_s)
    finally:
        for proc in procs:  # a failed node: the others' sessions close (SIGTERM reaches their agents)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for proc in procs:
        if proc.stdin:
            proc.stdin.close()
    for t in pumps:
        t.join(timeout=5)
    if not order:
        return 0, None
    # the cause: a node whose line is not a lost peer's, one whose rank died of a signal, the first seen
    bad = min(order, key=lambda i: (lost_peer(last.get(i, "")), (procs[i].returncode or 0) <= 128,
                                    order.index(i)))
    proc = procs[bad]
    line = last.get(bad) or f"node {hosts[bad]} failed (ssh exit {proc.returncode})"
    return proc.returncode or 1, line
