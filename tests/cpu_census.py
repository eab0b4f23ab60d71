"""Where the suite's CPU goes: with ``DEEPSHARD_TEST_CPU=FILE``, each test's wall time and the CPU
seconds its pytest worker's whole process tree spent meanwhile (the worker, its gloo pool and app
runner, every launcher and rank they started) are appended to FILE as JSON lines, with the test's start
(epoch seconds: what the other worker ran meanwhile, for a test whose wall time its CPU does not explain).

Two workers share two cores, so a test's wall time depends on its neighbour; its CPU does not, and
the suite's wall time on a fresh clone is bounded below by the CPU all tests spend over the cores.
A process's own time plus the time of the children it reaped counts every process of the tree once
(a dead child's time moves into its parent's), so the census is the sum over the live tree."""

from __future__ import annotations

import json
import os
import time

import pytest

_FILE = os.environ.get("DEEPSHARD_TEST_CPU")


def tree_cpu_seconds() -> float:
    """User + system seconds of this process and every live descendant, with the children each reaped."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # ended between the listing and the read: its parent holds its time now
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    if not _FILE:
        yield
        return
    cpu, wall, start = tree_cpu_seconds(), time.perf_counter(), time.time()
    yield
    record = {"test": item.nodeid, "start": round(start, 2), "wall": round(time.perf_counter() - wall, 2),
              "cpu": round(tree_cpu_seconds() - cpu, 2), "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    with open(_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")
