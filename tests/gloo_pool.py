"""A pool of gloo worker processes that lives for the whole pytest run.

Each of ``world`` workers (forked from ``launch_local``'s server, which imported torch) joins one gloo
group once, then runs test functions (module-level, picklable) on every rank and sends back their return
values.  A launch of ``launch_local`` pays for a fresh elastic agent, rendezvous and group, and a fresh
import of the test's modules (transformers, the app) in each worker; the pool pays for them once.

Nothing of one test reaches the next: before each call every rank puts back the RNG states (torch,
Python, NumPy), the environment, the working directory, the default dtype, the thread count and grad
mode it had right after joining, and after the call it destroys every process group the function made
(a mesh's sub-groups); a function that destroyed the default group gets a fresh one.  A rank that
raises, dies or does not answer within the timeout fails that call with one line naming the rank, and
the pool is restarted for the next test.  Fault-injection tests (killed ranks, hangs on purpose) and
tests that measure a process's memory keep their own processes (``launch_local``).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT_S = 600.0
ERROR_GRACE_S = 2.0


class PoolFailure(AssertionError):
    """A call that failed on some rank: ``str`` is the one line (the root cause), ``tracebacks`` every rank's."""

    def __init__(self, line: str, tracebacks: dict[int, str]) -> None:
        super().__init__(line)
        self.tracebacks = tracebacks

    def __str__(self) -> str:
        traces = "".join(f"\n--- rank {r} ---\n{t}" for r, t in sorted(self.tracebacks.items()))
        return self.args[0] + traces


def _join(store: Any, generation: int, rank: int, world: int) -> None:
    import torch.distributed as dist

    prefix = dist.PrefixStore(f"gloo_pool/{generation}", store)
    dist.init_process_group("gloo", store=prefix, rank=rank, world_size=world)


def _snapshot() -> dict[str, Any]:
    """What a test may change and the next test must not see."""
    import random

    import torch

    state = {"env": dict(os.environ), "cwd": os.getcwd(), "dtype": torch.get_default_dtype(),
             "threads": torch.get_num_threads(), "warnings": list(warnings.filters),
             "torch_rng": torch.random.get_rng_state(),
             "py_rng": random.getstate(), "np_rng": None}
    try:
        import numpy as np

        state["np_rng"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _restore(state: dict[str, Any]) -> None:
    import random

    import torch

    os.environ.clear()
    os.environ.update(state["env"])
    os.chdir(state["cwd"])
    torch.set_default_dtype(state["dtype"])
    torch.set_default_device(None)
    warnings.filters[:] = state["warnings"]
    torch.set_num_threads(state["threads"])
    torch.set_grad_enabled(True)
    torch.random.set_rng_state(state["torch_rng"])
    random.setstate(state["py_rng"])
    if state["np_rng"] is not None:
        import numpy as np

        np.random.set_state(state["np_rng"])


def _forget_meshes() -> None:
    """Empty DTensor's caches keyed by mesh: a DeviceMesh hashes by its layout, not its groups, so a
    later test's mesh of the same layout would find this test's entries, naming destroyed groups."""
    from torch.distributed.tensor import _redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    for cached in (getattr(_redistribute, "_gen_transform_infos", None), MeshTopoInfo.build_from_mesh):
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()


def _drop_extra_groups(store: Any, generation: list[int], rank: int, world: int) -> None:
    """Destroy the groups the call made (sub-groups of meshes); rejoin if it destroyed the default one.
    Then collect the call's garbage: a destroyed group whose last references sit in reference cycles (an
    engine, its meshes) keeps its gloo threads (a TCP loop and two run loops, each waking to poll) until
    Python's collector runs, which an idle worker rarely triggers: a world-4 pool had grown ~230 of them,
    ~7% of a core per rank while waiting for the next test."""
    import gc

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    _forget_meshes()
    if dist.is_initialized():
        default = _world.default_pg
        for pg in [pg for pg in list(_world.pg_map) if pg is not default]:
            dist.destroy_process_group(pg)
        gc.collect()
    else:
        generation[0] += 1
        _join(store, generation[0], rank, world)


def _serve(rank: int, world: int, port: int, conn: Any) -> None:
    """A worker: join the group once, then run each call it is sent until told to stop (an empty message)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the server ignores it (forkserver_guard); a worker must not
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=True)
    generation = [0]
    _join(store, 0, rank, world)
    state = _snapshot()
    conn.send_bytes(b"ready")
    while True:
        task = conn.recv_bytes()
        if not task:
            break
        _restore(state)
        try:
            fn, args, kwargs = pickle.loads(task)
            reply = pickle.dumps(("ok", fn(*args, **kwargs)))
        except BaseException as err:  # noqa: B036 - the parent must hear of any failure, SystemExit too
            reply = pickle.dumps(("error", f"{type(err).__name__}: {err}", traceback.format_exc()))
        _drop_extra_groups(store, generation, rank, world)
        conn.send_bytes(reply)
    dist.destroy_process_group()


class GlooPool:
    """``world`` ranks in one gloo group; ``pool.run(fn, *args)`` returns each rank's ``fn(*args)``, rank-ordered."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._procs: list[Any] = []
        self._conns: list[Any] = []

    def _start(self) -> None:
        from deepshard.core.mesh import free_port
        from deepshard.launch.local import start_worker_server

        # fork from launch_local's server (torch and deepshard imported once): a spawned worker
        # would import torch again, ~4 s of CPU per rank
        start_worker_server(_serve)
        ctx = mp.get_context("forkserver")
        port = free_port()
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, self.world, port, child), daemon=True,
                               name=f"gloo_pool-w{self.world}-r{rank}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(b"", timeout_s=120.0, what="start")

    def close(self, *, force: bool = False) -> None:
        """Stop every worker (politely, or at once with ``force``, then by SIGKILL); the next ``run`` starts fresh ones."""
        for conn in [] if force else self._conns:
            try:
                conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + (0.0 if force else 5.0)
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def _death(self, rank: int, what: str) -> str:
        self._procs[rank].join(1.0)  # the pipe closes before the exit status is reaped
        code = self._procs[rank].exitcode
        return f"gloo pool ({what}): rank {rank} died (exit code {code}); the pool restarts"

    def _collect(self, task: bytes, *, timeout_s: float, what: str) -> list[Any]:
        """Send ``task`` (nothing at start) to every rank and wait for every answer, a death or the timeout.
        Once a rank answered with an error its peers get ``ERROR_GRACE_S`` more (they may be stuck in a
        collective with it): the ranks that answered by then are the ones reported."""
        if task:
            try:
                for conn in self._conns:
                    conn.send_bytes(task)
            except OSError:  # a worker died between calls
                self.close(force=True)
                self._start()
                return self._collect(task, timeout_s=timeout_s, what=what)
        answers: dict[int, Any] = {}
        by_conn = {id(c): r for r, c in enumerate(self._conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self._procs)}
        deadline = time.monotonic() + timeout_s
        failed: tuple[int, str] | None = None
        while len(answers) < self.world and failed is None:
            left = deadline - time.monotonic()
            pending = [c for r, c in enumerate(self._conns) if r not in answers]
            pending += [p.sentinel for r, p in enumerate(self._procs) if r not in answers]
            ready = mpc.wait(pending, timeout=max(0.0, left))
            if not ready and any(pickle.loads(a)[0] == "error" for a in answers.values()):
                break  # the error is the cause; the silent peers wait on the rank that raised
            if not ready:
                silent = [r for r in range(self.world) if r not in answers]
                failed = (silent[0], f"gloo pool ({what}): rank(s) {silent} gave no answer within {timeout_s:.0f} s "
                                     "(hung); the pool restarts")
                break
            for obj in ready:
                if obj in by_sentinel:
                    rank = by_sentinel[obj]
                    if rank not in answers and not self._conns[rank].poll():
                        failed = (rank, self._death(rank, what))
                else:
                    rank = by_conn[id(obj)]
                    try:
                        answers[rank] = obj.recv_bytes()
                    except EOFError:  # its end of the pipe closed: it died
                        failed = (rank, self._death(rank, what))
                        break
                    if task and pickle.loads(answers[rank])[0] == "error":
                        deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        if failed is not None:
            self.close(force=True)
            raise PoolFailure(failed[1], {})
        return [answers.get(r, pickle.dumps(("silent", "", ""))) for r in range(self.world)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; a raise on any rank is one ``PoolFailure`` naming the first."""
        if not self._procs:
            self._start()
        replies = [pickle.loads(b) for b in self._collect(pickle.dumps((fn, args, kwargs)), timeout_s=timeout_s,
                                                           what=getattr(fn, "__qualname__", repr(fn)))]
        errors = {r: reply for r, reply in enumerate(replies) if reply[0] != "ok"}
        if errors:
            self.close(force=True)  # a rank that raised mid-collective may have left its peers' group state torn
            rank = min(r for r, e in errors.items() if e[0] == "error")
            raise PoolFailure(f"gloo pool: rank {rank}: {errors[rank][1]}", {r: e[2] for r, e in errors.items() if e[2]})
        return [reply[1] for reply in replies]


_POOLS: dict[int, GlooPool] = {}


def pool(world: int) -> GlooPool:
    """The session's pool of ``world`` ranks (started on first use; ``close_pools`` ends them all)."""
    if world not in _POOLS:
        _POOLS[world] = GlooPool(world)
    return _POOLS[world]


def close_pools() -> None:
    """Stop every pool's workers (the session's end)."""
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()
