"""The launcher tests' shared references: one uninterrupted one-node world-2 run of compat_loop.py, and one
of the app (test_cli_restart.RUN)."""

from __future__ import annotations

import sys

import pytest

from tests.launch.compat_runs import final_losses, run_loop


@pytest.fixture(scope="session")
def one_node_losses(tmp_path_factory) -> dict[tuple[int, int], str]:
    """``deepshard --num_gpus=2 compat_loop.py``: 12 ZeRO-3 steps on 2 ranks, (rank, step) -> loss."""
    code, err, rows = run_loop(["--num_gpus=2"], tmp_path_factory.mktemp("one_node"))
    assert code == 0, err[-3000:]
    losses = final_losses(rows)
    assert sorted(losses) == [(r, s) for r in (0, 1) for s in range(1, 13)]
    return losses


@pytest.fixture(scope="session")
def whole_app_losses(tmp_path_factory) -> dict[int, float]:
    """The app's own 2 local workers, uninterrupted, on test_cli_restart.RUN: step -> logged loss."""
    from tests.launch.test_cli_restart import MAIN, RUN, launch, losses

    run_dir = tmp_path_factory.mktemp("whole_app")
    code, _, err = launch([sys.executable, str(MAIN), *RUN, f"hydra.run.dir={run_dir / 'whole'}"], run_dir, {})
    assert code == 0, err[-3000:]
    return losses(run_dir / "whole")
