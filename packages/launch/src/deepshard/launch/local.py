"""Start local worker processes with torch's elastic launcher (used by the app and the tests).

A worker that raises, dies or hangs ends the whole job with one ``JobFailed`` naming the rank and
the cause, never a hang: a raised error is ``rank 1: ValueError: ...``, a killed worker ``rank 1
died with SIGKILL``, and with ``hang_s`` a watchdog over the workers' heartbeats (see
``deepshard.launch.heartbeat``) ends a job whose rank made no progress for that long.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from deepshard.core.checkpoint.plain_files import open_file
from deepshard.core.host_malloc import set_mmap_threshold
from deepshard.core.mesh import free_port
from deepshard.launch import worker_server
from deepshard.launch.deaths import lost_peer
from deepshard.launch.failed_group_stop import stop_failed_groups_within
from deepshard.launch.heartbeat import ENV_DIR, Hang, Watchdog, read_beats, remove_dead_beats
from deepshard.launch.memory import OomWatch, raise_oom_score
from deepshard.launch.parent_death import die_with_parent
from deepshard.launch.rendezvous_names import name_steps_cheaply

_PEER_GRACE_S = 1.0

# this process's environment when this module was imported: in a forkserver worker, the server's
_ENV_AT_IMPORT = dict(os.environ)

class JobFailed(RuntimeError):
    """The job's root cause in one line (``str``), its rank and kind, and every rank's traceback."""

    def __init__(self, line: str, *, rank: int, kind: str, error_type: str = "",
                 tracebacks: dict[int, str] | None = None, hang: Hang | None = None,
                 memory_limit: int | None = None) -> None:
        super().__init__(line)
        self.rank, self.kind, self.error_type, self.hang = rank, kind, error_type, hang
        self.tracebacks = tracebacks or {}
        self.memory_limit = memory_limit  # kind "oom": the memory cgroup's limit that the rank met


def _describe(rank: int, failure: Any) -> tuple[int, str, str, str, str]:
    """(priority, kind, error type, one line, traceback) of one rank's failure; lower priority = root cause."""
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    message = data.get("message", {})
    if isinstance(message, dict):
        trace = str(message.get("extraInfo", {}).get("py_callstack", ""))
        message = message.get("message", "")
    else:
        trace = ""
    message = " ".join(str(message).split())
    if failure.exitcode < 0:
        name = failure.signal_name()
        prio = 3 if failure.exitcode in (-signal.SIGTERM, -signal.SIGINT) else 0  # the launcher's own SIGTERM
        return prio, "signal", name, f"rank {rank} died with {name}", trace
    if message:
        error_type = message.split(":", 1)[0]
        prio = 2 if lost_peer(message) else 1
        return prio, "exception", error_type, f"rank {rank}: {message}", trace
    return 2, "exit", "", f"rank {rank} exited with code {failure.exitcode}", trace


def _with_peer_error_files(failures: dict[int, Any]) -> dict[int, Any]:
    """``failures`` plus every other local rank that left an error file.

    The multiprocessing context reports only the first process to exit; the rank that raised the real cause
    writes its error file first (``train_worker``) but may still be closing down, and be terminated,
    when a peer that lost its connection exits: its file (``.../attempt_N/<local_rank>/error.json``)
    still names the cause.  Local ranks are global ranks here: this launcher runs one node.
    """
    out = dict(failures)
    for failure in failures.values():
        error_file = getattr(failure, "error_file", None)
        attempt = Path(error_file).parent.parent if error_file else None
        if attempt is None or not attempt.is_dir():
            continue
        for rank_dir in attempt.iterdir():
            error_file = rank_dir / "error.json"
            if rank_dir.name.isdigit() and int(rank_dir.name) not in out and error_file.is_file():
                out[int(rank_dir.name)] = ProcessFailure(local_rank=int(rank_dir.name), pid=-1, exitcode=1,
                                                         error_file=str(error_file))
    return out


def killed_for_memory_line(rank: int, last_beat: dict | None, limit: int | None = None) -> str:
    """``rank R was killed for memory at step S (phase)`` from the rank's last heartbeat; with ``limit``
    (a caller that has no estimate of its own to add, the ``deepshard`` command) the limit it met."""
    started = last_beat is not None and last_beat["phase"] != "startup"
    line = f"rank {rank} was killed for memory " + (f"at step {last_beat['step']} ({last_beat['phase']})"
                                                    if started else "before its first step")
    return line + (f" (memory limit {limit / 2**30:.2f} GiB)" if limit else "")


def job_failed(child_failed: Any, hang: Hang | None = None, beats: list[dict] | None = None,
               oom: OomWatch | None = None) -> JobFailed:
    """The root cause among a ChildFailedError's failures and its peers' error files (or the
    watchdog's hang, which caused them); a rank that died by a signal is named with its last
    heartbeat's step and phase, and a SIGKILL the memory cgroup's OOM killer sent (``oom``) as a
    kill for memory (kind "oom", with the limit)."""
    failures = _with_peer_error_files(child_failed.failures)
    described = {rank: _describe(rank, f) for rank, f in failures.items()}
    traces = {rank: d[4] for rank, d in described.items() if d[4]}
    if hang is not None:
        return JobFailed(str(hang), rank=hang.rank, kind="hang", tracebacks=traces, hang=hang)
    rank = min(described, key=lambda r: (described[r][0], failures[r].timestamp, r))
    _, kind, error_type, line, _ = described[rank]
    last = next((b for b in beats or [] if b["rank"] == rank), None)
    started = last is not None and last["phase"] != "startup"
    if oom is not None and oom.explains(error_type):
        return JobFailed(killed_for_memory_line(rank, last), rank=rank, kind="oom", error_type=error_type,
                         tracebacks=traces, memory_limit=oom.limit())
    if kind == "signal" and started:
        line += f" during step {last['step']} ({last['phase']})"
    return JobFailed(line, rank=rank, kind=kind, error_type=error_type, tracebacks=traces)


@contextlib.contextmanager
def _elastic_logs_to(log_file: str | None) -> Iterator[None]:
    """torchelastic's and multiprocessing's log lines (its tracebacks of failed workers) go to ``log_file``."""
    if log_file is None:
        yield
        return
    Path(log_file).parent.mkdir(parents=True, exist_ok=True)
    stream = open_file(log_file, "a")  # never through a link (ValueError): it would append to its target
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    saved = [(lg.propagate, lg.level) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
        lg.setLevel(logging.INFO)
    try:
        yield
    finally:
        for lg, (propagate, level) in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.propagate, lg.level = propagate, level
        handler.close()
        stream.close()


def worker_threads(nproc: int, *, cuda: bool, cpus: int | None = None) -> int:
    """OpenMP threads per local worker.  With GPUs each rank gets its share of the cores this
    process may use (``sched_getaffinity``): the host AdamW of CPU/NVMe offload, the host-side
    casts and the data pipeline run there, and one thread starves them.  On a CPU-only host 1: the
    ranks' compute already contends for the same cores, and a fixed count keeps
    CPU results independent of the host's core count."""
    if not cuda:
        return 1
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, nproc))


def workers_on_cpu(nproc: int, cuda_devices: int) -> bool:
    """More local workers than GPUs: nccl cannot give each rank a GPU, so the workers run on the CPU
    with gloo (the test suite's multi-rank tests on a one-GPU host).  The app refuses such a
    ``launcher.nproc_per_node`` before launch instead."""
    return 0 < cuda_devices < nproc


def _in_launch_env(env: dict[str, str], parent: int | None, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` with the launcher's environment as of this launch, under torchelastic's per-rank
    variables; the worker dies with ``parent`` (the forkserver, which ends with the launcher).  forkserver's workers fork from a server that kept the environment of the process's
    first launch (spawn would start each from the launcher's current one); multiprocessing already
    gives them the launcher's current ``sys.path`` and directory.  As a spawned worker would, it runs
    its exit handlers when ``fn`` ends."""
    import torch

    if parent is not None:
        die_with_parent(parent)  # a SIGKILLed launcher leaves no worker behind
    raise_oom_score()  # out of memory, a worker dies first: the launcher lives to say so
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ignores it (forkserver_guard); a worker must not
    per_rank = {k: v for k, v in os.environ.items() if _ENV_AT_IMPORT.get(k) != v}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(per_rank)
    if "OMP_NUM_THREADS" in os.environ:  # torch read the server's value when it was imported there
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:  # glibc read the server's environment, at its start
        set_mmap_threshold(int(os.environ["MALLOC_MMAP_THRESHOLD_"]))
    try:
        return fn(*args)
    except Exception as err:
        if lost_peer(str(err)):  # a peer is gone: the launcher must see its end first,
            time.sleep(_PEER_GRACE_S)  # the cause (a forked worker exits in ms; the launcher polls each 0.1 s)
        raise
    finally:  # a forked worker leaves by os._exit: its exit handlers (swap-file removal, ...) run here
        atexit._run_exitfuncs()


def _claim_heartbeats(beat_dir: Path) -> None:
    """Remove an earlier run's heartbeat files (their pids must never be judged or killed); refuse
    (ValueError) if some belong to processes that still run: another job's watchdog reads them, and a
    hung rank of that job would go unseen (or this job's watchdog would blame and kill it)."""
    live = remove_dead_beats(beat_dir)
    if live:
        f, beat = live[0]
        raise ValueError(f"heartbeat_dir={beat_dir}: {f.name} belongs to pid {beat['pid']} on host "
                         f"{beat.get('host', 'this host')}, which is alive: another job reports its heartbeats "
                         "here; wait for it, or use another directory")


# what torch's elastic_launch writes into the calling process's environment itself
TORCH_SETS = ("TORCHELASTIC_SIGNALS_TO_HANDLE",)


@contextlib.contextmanager
def scoped_environment(updates: dict[str, str]) -> Iterator[None]:
    """``updates`` in ``os.environ`` for a launch (the workers inherit them), and the caller's environment
    as it was afterwards, also where torch's elastic agent wrote into it: a process that launches (a
    notebook, a test, the app runner) keeps the environment it had."""
    saved = {k: os.environ.get(k) for k in (*updates, *TORCH_SETS)}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def elastic_log_dir() -> str:
    """A directory for torch's elastic agent's per-rank error files, which the caller removes when the
    launch ends (torch's default, ``tempfile.mkdtemp("torchelastic_")`` per launch, is never removed)."""
    return tempfile.mkdtemp(prefix="deepshard-elastic-")


def start_worker_server(fn: Callable[..., Any], *, preload: Sequence[str] = ()) -> None:
    """Start the forkserver :func:`launch_local`'s workers fork from (``worker_server``), importing
    ``fn``'s module and ``preload`` (what the workers import later) beside torch and deepshard, in
    the background: a launcher that calls this before its own pre-launch checks overlaps the two.
    Only the first call in a process starts one; later calls change nothing."""
    worker_server.start_worker_server([fn.__module__, *preload])


def launch_local(fn: Callable[..., Any], nproc: int, *args: Any, threads_per_worker: int | None = None,
                 run_id: str | None = None, heartbeat_dir: str | None = None, hang_s: float = 0.0,
                 log_file: str | None = None, grace_s: int = 30) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local ranks (gloo/nccl group set up by the worker via
    ``init_distributed``); returns each rank's return value, rank-ordered.  ``run_id`` reaches the
    workers as ``TORCHELASTIC_RUN_ID`` (it names per-run scratch such as NVMe swap dirs).

    ``heartbeat_dir`` reaches the workers as ``DEEPSHARD_HEARTBEAT_DIR`` (``Heartbeat.from_env``);
    with ``hang_s > 0`` a watchdog kills the job once a rank made no progress for that long.
    ``log_file`` receives torchelastic's own log lines instead of stderr.  Raises ``JobFailed``, or
    ValueError before any worker starts when ``heartbeat_dir`` holds the heartbeats of live processes.
    ``threads_per_worker`` (OMP_NUM_THREADS of each worker) defaults to :func:`worker_threads`.
    ``grace_s``: when this process is signalled (SIGTERM/SIGINT: torchelastic's ``SignalException``), the
    workers get the signal too and are SIGKILLed this long after it (torchelastic's shutdown timeout).

    Workers fork from multiprocessing's forkserver, which imports torch, deepshard and ``fn``'s
    module once per launcher process (a spawned worker imports them again, ~5 s of CPU per rank
    per launch); the server imports no CUDA state, so each worker still initializes its own.
    """
    import torch
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    name_steps_cheaply()
    stop_failed_groups_within()  # a failed group's stuck survivor is killed in seconds, not torch's 30
    if heartbeat_dir is not None:
        beat_dir = Path(heartbeat_dir)
        beat_dir.mkdir(parents=True, exist_ok=True)
        _claim_heartbeats(beat_dir)
    hide_gpus = workers_on_cpu(nproc, torch.cuda.device_count())
    if threads_per_worker is None:  # auto: see worker_threads
        threads_per_worker = worker_threads(nproc, cuda=torch.cuda.is_available() and not hide_gpus)
    updates = {"OMP_NUM_THREADS": str(threads_per_worker)}  # inherited by the workers
    if heartbeat_dir is not None:
        updates[ENV_DIR] = str(beat_dir)
    if hide_gpus:
        logging.getLogger(__name__).warning(
            "launch_local: %d workers > %d visible GPU(s): the workers run on the CPU with gloo "
            "(nccl needs one GPU per rank)", nproc, torch.cuda.device_count())
        updates["CUDA_VISIBLE_DEVICES"] = ""  # the workers see no GPU
    elastic_logs = elastic_log_dir()  # torch's default is a fresh /tmp/torchelastic_* per launch, never removed
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id or uuid.uuid4().hex[:8],
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}", max_restarts=0,
        monitor_interval=0.1, start_method="forkserver", shutdown_timeout=grace_s,
        logs_specs=DefaultLogsSpecs(log_dir=elastic_logs),
    )
    with scoped_environment(updates):
        start_worker_server(fn)
        oom = OomWatch()  # the memory cgroup's OOM kills from here on are this job's
        watchdog = Watchdog(beat_dir, hang_s) if heartbeat_dir is not None and hang_s > 0 else None
        try:
            with _elastic_logs_to(log_file), watchdog or contextlib.nullcontext():
                entry = functools.update_wrapper(functools.partial(_in_launch_env, dict(os.environ), worker_server.server_pid(), fn), fn)
                results = elastic_launch(config, entry)(*args)
        except ChildFailedError as err:
            beats = read_beats(heartbeat_dir) if heartbeat_dir is not None else None
            raise job_failed(err, watchdog.hang if watchdog else None, beats, oom) from err
        finally:
            shutil.rmtree(elastic_logs, ignore_errors=True)  # the workers' error files were read above
    return [results[r] for r in range(nproc)]
