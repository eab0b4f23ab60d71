"""The hang watchdog under ``--max_restarts``: after it kills a hung attempt it keeps watching, so a
hang of a restarted attempt is caught too (it used to watch once per launcher: the chaos soak's
second SIGSTOP hung the job for good), and the files the killed workers left are never judged again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from deepshard.core.checkpoint.owners import process_start
from deepshard.launch.heartbeat import Watchdog


def beat(directory: Path, rank: int, proc: subprocess.Popen, *, age_s: float) -> None:
    """A heartbeat file as a worker writes it, its last beat ``age_s`` ago."""
    t = time.time() - age_s
    state = {"rank": rank, "pid": proc.pid, "step": 7, "phase": "forward", "since": t, "marks": 3, "beat": t,
             "host": os.uname().nodename, "process": process_start(proc.pid), "wrote": 0.0, "wrote_bytes": 0}
    (directory / f"rank{rank}.json").write_text(json.dumps(state))


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_hang_after_a_restart_is_caught_and_dead_workers_files_are_not_judged(tmp_path):
    worker = [sys.executable, "-c", "import time; time.sleep(60)"]
    first, second = subprocess.Popen(worker), subprocess.Popen(worker)
    try:
        with Watchdog(tmp_path, hang_s=1.0, poll_s=0.05) as dog:
            beat(tmp_path, 0, first, age_s=5)  # attempt 1: rank 0 stopped beating
            assert wait_for(lambda: first.poll() is not None), "the hung worker was not killed"
            assert dog.hang is not None and dog.hang.rank == 0
            beat(tmp_path, 1, second, age_s=0)  # attempt 2 beats; rank 0's file is still the dead worker's
            end = time.monotonic() + 1.5
            while time.monotonic() < end:
                beat(tmp_path, 1, second, age_s=0)
                time.sleep(0.1)
            assert second.poll() is None, "a healthy worker was killed for a dead one's old file"
            beat(tmp_path, 1, second, age_s=5)  # attempt 2 hangs too
            assert wait_for(lambda: second.poll() is not None), "the restarted worker's hang was not caught"
            assert dog.hang.pid == second.pid and dog.hang.rank == 1
    finally:
        for p in (first, second):
            p.kill()
            p.wait()
