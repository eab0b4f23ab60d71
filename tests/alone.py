"""Tests marked ``alone`` run with no neighbour.  The suite runs on two pytest-xdist workers; a test whose
verdict depends on the host being otherwise idle (a bound on seconds, a cgroup's usage, which charges a
page to whoever reads the file first) takes the run's room exclusively: the other worker finishes its
current test and waits.  Every other test takes the room shared.  A turnstile ahead of the room keeps a
stream of shared takers from starving an exclusive one.  Without xdist (one process) nothing is locked."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def _room(base: Path, *, exclusive: bool) -> Iterator[None]:
    with open(base / "deepshard-turnstile.lock", "a") as turn, open(base / "deepshard-room.lock", "a") as room:
        fcntl.flock(turn, fcntl.LOCK_EX)
        if not exclusive:
            fcntl.flock(turn, fcntl.LOCK_UN)
        fcntl.flock(room, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if exclusive:
            fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    basetemp = item.config.option.basetemp  # xdist gives each worker <the run's temp dir>/popen-gwN
    if "PYTEST_XDIST_WORKER" not in os.environ or not basetemp:
        return (yield)
    with _room(Path(basetemp).parent, exclusive=item.get_closest_marker("alone") is not None):
        return (yield)
