"""The launcher tests' shared references: one uninterrupted world-2 run of compat_loop.py (on the session's
gloo pool), and one of the app (test_cli_restart.RUN).

Each is computed once per pytest run, not once per xdist worker: the files that compare against them
(test_cli_restart, test_cli_ssh, test_node_restart) usually land on different workers, and each
reference is a 2-rank run.  The first worker to ask computes it under a file lock in the run's temp
dir (shared by the workers, fresh per run) and leaves it there as JSON; the other one waits and reads it."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.launch.compat_runs import final_losses


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[Path], Any]) -> Any:
    """``compute(work_dir)`` (JSON-able) once for the whole pytest run, whichever worker asks first."""
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: the basetemp's parent outlives the run
        return compute(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent  # <the run's temp dir>/popen-gwN's parent: this run's
    with open(shared / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / f"{name}.json"
        if not done.exists():
            value = compute(tmp_path_factory.mktemp(name))
            done.write_text(json.dumps(value))
        return json.loads(done.read_text())


def _one_node(work: Path) -> list[list]:
    """The session's world-2 gloo pool runs the script's ``main`` (the same plain computation as
    ``deepshard --num_gpus=2 compat_loop.py``, one thread per rank as the launcher's workers have, without a
    launch of its own: ~12 s of CPU here)."""
    from tests.gloo_pool import pool
    from tests.launch.compat_loop import on_pool_rank

    pool(2).run(on_pool_rank, str(work))
    rows = [json.loads(line) for line in (work / "losses.jsonl").read_text().splitlines()]
    return [[rank, step, loss] for (rank, step), loss in final_losses(rows).items()]


@pytest.fixture(scope="session")
def one_node_losses(tmp_path_factory) -> dict[tuple[int, int], str]:
    """compat_loop.py uninterrupted on 2 ranks (the session's gloo pool): 8 ZeRO-3 steps, (rank, step) -> loss."""
    losses = {(rank, step): loss for rank, step, loss in once_per_run(tmp_path_factory, "one_node", _one_node)}
    assert sorted(losses) == [(r, s) for r in (0, 1) for s in range(1, 9)]
    return losses


def _whole_app(work: Path) -> dict[str, float]:
    """The app run through this worker's app runner (it signals nothing: no fresh interpreter needed)."""
    from tests.app_runner import run_main
    from tests.launch.test_cli_restart import RUN, losses

    proc = run_main([*RUN, f"hydra.run.dir={work / 'whole'}"], cwd=work, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {str(step): loss for step, loss in losses(work / "whole").items()}


@pytest.fixture(scope="session")
def whole_app_losses(tmp_path_factory) -> dict[int, float]:
    """The app's own 2 local workers, uninterrupted, on test_cli_restart.RUN: step -> logged loss."""
    return {int(step): loss for step, loss in once_per_run(tmp_path_factory, "whole_app", _whole_app).items()}
