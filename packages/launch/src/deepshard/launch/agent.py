"""One node of a ``deepshard`` job: torch's elastic agent runs the node's workers.

Every node (one, or each host of a hostfile) runs ``elastic_launch`` with a c10d rendezvous at
``master_addr:master_port``: the agent starts ``nproc`` workers with ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, restarts them up to ``max_restarts``
times when one fails, and stops the rest when one dies.  This module turns the agent's verdict
into one line (``rank 1 on host-a died with SIGKILL``) and an exit code, and watches the workers'
heartbeats (``deepshard.launch.heartbeat``) to name a rank that hangs.

torch (and :mod:`.local`, which imports it) is imported where a node's agent runs, not when this module
is: the ``deepshard`` process that only starts the nodes over ssh or srun never needs it (its import:
~1.5 s of CPU here, before the first ssh and in each refusal).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deepshard.launch.deaths import DeathWatch
from deepshard.launch.heartbeat import ENV_DIR, Watchdog, agent_beat_dir, read_beats, remove_dead_beats
from deepshard.launch.memory import OomWatch
from deepshard.launch.parent_death import guarded

LOCAL_RANK_MACRO = "${local_rank}"  # torch's agent puts each worker's local rank here (elastic.utils.macros)


@dataclass(frozen=True)
class NodeConfig:
    """What this node's agent needs; every node of a job gets the same except ``nproc``, ``host``,
    ``is_host`` and ``devices``."""

    nproc: int
    master_addr: str
    master_port: int
    run_id: str
    min_nodes: int = 1
    max_nodes: int = 1
    max_restarts: int = 0
    host: str = "localhost"  # this node's name in messages
    is_host: bool | None = None  # hosts the rendezvous store (None: the agent decides by address)
    devices: tuple[int, ...] | None = None  # GPU slots of this node (CUDA_VISIBLE_DEVICES); None: all
    env: dict[str, str] = field(default_factory=dict)  # .deepspeed_env and forwarded variables
    hang_s: float = 0.0  # a rank that reports progress and makes none this long ends the job; 0: never


@dataclass(frozen=True)
class Failure:
    line: str
    code: int  # the process's exit status as a shell reports it: N, or 128 + signal number


def worker_command(script: str, args: Sequence[str], *, module: bool, no_python: bool,
                   no_local_rank: bool) -> tuple[str, list[str]]:
    """(executable, arguments) of each worker, as DeepSpeed builds it: ``python -u script
    --local_rank=N args``, ``python -u -m module ...``, or the executable itself (``--no_python``)."""
    local_rank = [] if no_local_rank else [f"--local_rank={LOCAL_RANK_MACRO}"]
    if no_python:
        return script, [*local_rank, *args]
    return sys.executable, ["-u", *(["-m"] if module else []), script, *local_rank, *args]


def visible_devices(slots: Sequence[int], already: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` of a node's slots: slot i is the i-th GPU this process sees (the
    user's own ``CUDA_VISIBLE_DEVICES`` narrows the host's GPUs first)."""
    ids = [d.strip() for d in already.split(",") if d.strip()] if already else None
    return ",".join(ids[s] if ids is not None and s < len(ids) else str(s) for s in slots)


def describe(failures: dict[int, object], host: str, *, oom: OomWatch | None = None,
             beats: Sequence[dict] = ()) -> Failure:
    """The root cause among the agent's failed workers (keyed by global rank): a death by signal
    first, then an error, then a worker stopped by the agent; its host, rank and cause.  A SIGKILL the
    memory cgroup's OOM killer sent (``oom``) is named as a kill for memory, with the rank's last
    heartbeat (``beats``) and the limit."""
    from deepshard.launch.local import _describe, killed_for_memory_line

    failures = {rank: _without_empty_error(f) for rank, f in failures.items()}
    described = {rank: _describe(rank, f) for rank, f in failures.items()}
    rank = min(described, key=lambda r: (described[r][0], getattr(failures[r], "timestamp", 0), r))
    _, kind, error_type, line, _ = described[rank]
    if oom is not None and oom.explains(error_type):
        line = killed_for_memory_line(rank, next((b for b in beats if b.get("rank") == rank), None), oom.limit())
    line = line.replace(f"rank {rank}", f"rank {rank} on {host}", 1)
    attempt = re.search(r"attempt_(\d+)", str(getattr(failures[rank], "error_file", "")))
    if attempt and int(attempt.group(1)) > 0:  # torch's agent numbers each run of the workers
        line += f" (after {attempt.group(1)} restart(s): --max_restarts used up)"
    exitcode = int(getattr(failures[rank], "exitcode", 1))
    return Failure(line, 128 - exitcode if exitcode < 0 else exitcode or 1)


def with_first_death(failures: dict[int, object], deaths: DeathWatch, beats: Sequence[dict]) -> dict[int, object]:
    """``failures`` (the agent's, by global rank) plus the worker killed by a signal that died first, when
    the agent reported only a peer that failed after it (both dead by the time it looked): the
    watch's record (:mod:`.deaths`), its pid named by the rank's heartbeat."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    ranks = {int(b["pid"]): int(b["rank"]) for b in beats if "pid" in b and "rank" in b}
    ranks.update({int(f.pid): r for r, f in failures.items() if getattr(f, "pid", None)})  # type: ignore[attr-defined]
    got = deaths.first_killed(ranks)
    if got is None or (got[0] in failures and int(getattr(failures[got[0]], "exitcode", 0)) < 0):
        return failures
    rank, death = got
    reported = str(getattr(next(iter(failures.values())), "error_file", "") or "")
    # a name no worker writes, in the same attempt_N folder: describe() counts the restarts from it
    error_file = str(Path(reported).parent.parent / f"rank{rank}-killed" / "error.json") if reported else ""
    killed = ProcessFailure(local_rank=rank, pid=death.pid, exitcode=-death.signal, error_file=error_file)
    killed.error_file = error_file  # torch's ProcessFailure forgets a file that does not exist ("<N/A>")
    return {**failures, rank: killed}


def _without_empty_error(failure: object) -> object:
    """A script that wrote no error file (no ``@record``) is described by its exit code, not torch's ``<NONE>``."""
    data = getattr(failure, "error_file_data", None)
    if isinstance(data, dict) and data.get("message") in ("<NONE>", "<N/A>"):
        failure = copy.copy(failure)
        failure.error_file_data = {}
    return failure


class _RestartLine(logging.Filter):
    """Of the agent's INFO lines only its restart decision passes, as one line of ours."""

    def __init__(self, host: str, on_restart: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.host = host
        self.on_restart = on_restart

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        if "will restart worker group" in str(record.msg) and len(record.args or ()) == 4:
            _, state, left, most = record.args  # type: ignore[misc]
            if self.on_restart is not None:
                self.on_restart()
            print(f"deepshard: a worker on {self.host} {str(state).lower()}; restarting the workers "
                  f"(restart {int(most) - int(left) + 1} of {most})", file=sys.stderr, flush=True)
        return False


def _quiet_agent(host: str, on_restart: Callable[[], None] | None = None) -> None:
    """The agent's INFO lines (rendezvous rounds, worker groups) stay out of the job's output, but for its
    restarts (one line each); its warnings stay."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.WARNING)
    api = logging.getLogger("torch.distributed.elastic.agent.server.api")
    api.setLevel(logging.INFO)
    for f in [f for f in api.filters if isinstance(f, _RestartLine)]:
        api.removeFilter(f)
    api.addFilter(_RestartLine(host, on_restart))


def run_node(node: NodeConfig, entry: str, args: Sequence[str]) -> Failure | None:
    """Run this node's workers to the end; None when every worker succeeded, else the root cause."""
    import torch
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from deepshard.launch.failed_group_stop import stop_failed_groups_within
    from deepshard.launch.local import elastic_log_dir, scoped_environment, worker_threads
    from deepshard.launch.rendezvous_names import name_steps_cheaply

    name_steps_cheaply()
    stop_failed_groups_within()  # a restart after a death waits seconds for a stuck survivor, not torch's 30
    deaths = DeathWatch()  # who died first: the agent reports one failed worker, not always the cause
    _quiet_agent(node.host, on_restart=deaths.clear)
    env = dict(node.env)
    if "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(worker_threads(node.nproc, cuda=torch.cuda.is_available()))
    if node.devices is not None and torch.cuda.is_available():
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(node.devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
    # each rendezvous round (each restart) gives the workers a fresh store on a fresh MASTER_PORT: the agent's
    # shared store keeps the last attempt's keys, and restarted gloo ranks dial the dead ranks' addresses
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    own_beat_dir = ENV_DIR not in os.environ  # a directory the user names is used and left in place
    beat_dir = agent_beat_dir(node.run_id) if own_beat_dir else os.environ[ENV_DIR]
    if not own_beat_dir:
        remove_dead_beats(beat_dir)  # an earlier run's files are never judged
    env[ENV_DIR] = beat_dir
    elastic_logs = elastic_log_dir()
    config = LaunchConfig(
        min_nodes=node.min_nodes, max_nodes=node.max_nodes, nproc_per_node=node.nproc, run_id=node.run_id,
        rdzv_backend="c10d", rdzv_endpoint=f"{node.master_addr}:{node.master_port}",
        rdzv_configs={} if node.is_host is None else {"is_host": node.is_host},
        max_restarts=node.max_restarts, monitor_interval=0.1, start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=elastic_logs),
    )
    watchdog = Watchdog(beat_dir, node.hang_s) if node.hang_s > 0 else None
    oom = OomWatch()  # the memory cgroup's OOM kills from here on are this node's
    entry, args = guarded(entry, args, os.getpid())  # the workers die with this agent, even by SIGKILL
    try:
        with scoped_environment(env), watchdog or contextlib.nullcontext(), deaths:
            elastic_launch(config, entry)(*args)
        return None
    except ChildFailedError as err:
        if watchdog is not None and watchdog.hang is not None and (  # a hang of this attempt, not a restarted one's
                watchdog.hang.pid in {getattr(f, "pid", None) for f in err.failures.values()}):
            hang = watchdog.hang
            return Failure(str(hang).replace(f"rank {hang.rank}", f"rank {hang.rank} on {node.host}", 1)
                           + "; the workers were stopped", 1)
        beats = read_beats(beat_dir)
        return describe(with_first_death(err.failures, deaths, beats), node.host, oom=oom, beats=beats)
    except SignalException as err:
        return Failure(f"the launcher on {node.host} got {err.sigval.name}: its workers were stopped",
                       128 + int(err.sigval))
    except RendezvousError as err:
        return Failure(f"rendezvous at {node.master_addr}:{node.master_port} failed on {node.host}: "
                       f"{type(err).__name__}: {' '.join(str(err).split())}", 1)
    finally:
        shutil.rmtree(elastic_logs, ignore_errors=True)
        if own_beat_dir:
            shutil.rmtree(beat_dir, ignore_errors=True)


