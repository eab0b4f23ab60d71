"""Tests marked ``alone`` run with no neighbour.  The suite runs on two pytest-xdist workers; a test whose
verdict depends on the host being otherwise idle (GEMMs timed, a cgroup's usage, which charges a page to
whoever reads the file first, a hang told apart from a slow rank by seconds of heartbeats) takes the
run's room exclusively: the other worker finishes its
current test and waits.  Every other test takes the room shared.  A turnstile ahead of the room keeps a
stream of shared takers from starving an exclusive one.  Without xdist (one process) nothing is locked.
A fault test whose bound only says "it ends, long before it would hang" (a killed worker's job ending
within 30 s where it ends in ~2) is not ``alone``: a busy neighbour slows it by seconds, not by tens.

Each wait for the room is recorded (``deepshard-room.log`` beside the locks) and the run's terminal summary
adds them up: an exclusive test first waits for the other worker's current test to end, and that worker
then waits for it, so every ``alone`` test costs the run more than its own seconds."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def _room(base: Path, *, exclusive: bool, nodeid: str) -> Iterator[None]:
    with open(base / "deepshard-turnstile.lock", "a") as turn, open(base / "deepshard-room.lock", "a") as room:
        start = time.monotonic()
        fcntl.flock(turn, fcntl.LOCK_EX)
        if not exclusive:
            fcntl.flock(turn, fcntl.LOCK_UN)
        fcntl.flock(room, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if exclusive:
            fcntl.flock(turn, fcntl.LOCK_UN)
        waited = time.monotonic() - start
        if waited >= 0.5:
            with open(base / LOG, "a") as log:  # one short line, appended whole: the workers' lines never mix
                log.write(f"{waited:.1f}\t{'alone' if exclusive else 'shared'}\t{nodeid}\n")
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    basetemp = item.config.option.basetemp  # xdist gives each worker <the run's temp dir>/popen-gwN
    if "PYTEST_XDIST_WORKER" not in os.environ or not basetemp:
        return (yield)
    with _room(Path(basetemp).parent, exclusive=item.get_closest_marker("alone") is not None, nodeid=item.nodeid):
        return (yield)


LOG = "deepshard-room.log"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """The controller's summary: what the room's waits cost (the seconds each kind of taker waited)."""
    if "PYTEST_XDIST_WORKER" in os.environ or not hasattr(config, "_tmp_path_factory"):
        return
    log = config._tmp_path_factory.getbasetemp() / LOG  # xdist gave the workers <this dir>/popen-gwN
    if not log.is_file():
        return
    waits = [line.split("\t") for line in log.read_text().splitlines()]
    for kind in ("alone", "shared"):
        mine = sorted(((float(w), n) for w, k, n in waits if k == kind), reverse=True)
        if mine:
            terminalreporter.write_line(f"room: {len(mine)} {kind} test(s) waited {sum(w for w, _ in mine):.0f} s for the "
                                        f"room; longest {mine[0][0]:.0f} s ({mine[0][1]})")
