"""One job per directory (``deepshard.launch.run_lock``) with real processes: a second one is refused
naming the owner, a dead owner's lock is taken over with one log line, a lock recorded by another
host counts while it is renewed; and the launcher never removes heartbeat files of live processes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deepshard.core.mesh import free_port
from deepshard.launch.local import launch_local
from deepshard.launch.run_lock import LOCK_NAME, DirectoryInUse, acquire

pytestmark = pytest.mark.slow

HOLD = """
import sys, time
from deepshard.launch.run_lock import acquire
acquire(sys.argv[1], key="hydra.run.dir", job="first")
print("held", flush=True)
time.sleep(600)
"""


@contextlib.contextmanager
def _process(*args: str):
    """A child in its own session, killed with its group whatever the test does."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _takeovers(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]


def test_a_second_process_is_refused_naming_the_owner_and_takes_over_once_it_died(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with _process("-c", HOLD, str(tmp_path)) as holder:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(DirectoryInUse) as err:
            acquire(tmp_path, key="checkpoint.dir")
        assert isinstance(err.value, ValueError)  # main.py: one `error:` line, exit 2
        assert re.fullmatch(rf"checkpoint.dir={re.escape(str(tmp_path))} is in use by another deepshard job "
                            rf"\(pid {holder.pid} on host {re.escape(socket.gethostname())}, started "
                            r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\); wait for it, or use another directory",
                            str(err.value)), str(err.value)
        os.killpg(holder.pid, signal.SIGKILL)  # no release: the kernel drops the flock, the record stays
        holder.wait()
    assert (tmp_path / LOCK_NAME).is_file()
    assert _takeovers(caplog) == []
    lock = acquire(tmp_path, key="checkpoint.dir")
    (line,) = _takeovers(caplog)
    assert f"checkpoint.dir={tmp_path}: took over the lock of a deepshard job that is gone (pid {holder.pid} " in line
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()  # a clean end leaves nothing behind
    with acquire(tmp_path, key="checkpoint.dir"):  # ... and the next job starts without a word
        assert (tmp_path / LOCK_NAME).is_file()
    assert len(_takeovers(caplog)) == 1


def test_a_lock_recorded_by_another_host_holds_while_renewed(tmp_path, caplog):
    """Where flock does not reach other hosts (some shared filesystems) the record decides: renewed
    within the stale time it is held, else its job is gone."""
    caplog.set_level(logging.INFO)
    now = time.time()
    record = {"host": "elsewhere", "pid": 1, "started": now - 3600, "renewed": now - 5, "job": ""}
    (tmp_path / LOCK_NAME).write_text(json.dumps(record))
    with pytest.raises(DirectoryInUse, match=r"\(pid 1 on host elsewhere, started "):
        acquire(tmp_path, key="hydra.run.dir")
    (tmp_path / LOCK_NAME).write_text(json.dumps({**record, "renewed": now - 3000}))
    with acquire(tmp_path, key="hydra.run.dir"):
        (line,) = _takeovers(caplog)
        assert "(pid 1 on host elsewhere, started " in line


def test_a_held_lock_is_renewed_and_a_missing_directory_is_created_and_removed(tmp_path):
    directory = tmp_path / "a" / "checkpoints"
    with acquire(directory, key="checkpoint.dir", renew_s=0.05):
        first = json.loads((directory / LOCK_NAME).read_text())
        time.sleep(0.5)
        later = json.loads((directory / LOCK_NAME).read_text())
        assert first["pid"] == os.getpid() and later["renewed"] > first["renewed"]
    assert not (tmp_path / "a").exists()  # nothing was written there: no empty directories left


def _beat_file(directory: Path, rank: int, pid: int) -> Path:
    path = directory / f"rank{rank}.json"
    path.write_text(json.dumps({"rank": rank, "pid": pid, "step": 3, "phase": "forward", "since": time.time(),
                                "marks": 5, "beat": time.time(), "host": socket.gethostname()}))
    return path


def test_launch_local_keeps_the_heartbeats_of_live_processes_and_refuses(tmp_path):
    """Another job's hung rank must stay visible to its own watchdog: its file is never removed (an
    earlier run's files, of dead pids, are), and this launch refuses before any worker starts."""
    with _process("-c", "import time; time.sleep(600)") as live, _process("-c", "pass") as dead:
        dead.wait()
        kept, gone = _beat_file(tmp_path, 0, live.pid), _beat_file(tmp_path, 1, dead.pid)
        with pytest.raises(ValueError, match=rf"rank0.json .*pid {live.pid}.* is alive"):
            launch_local(free_port, 2, heartbeat_dir=str(tmp_path))
        assert kept.is_file() and not gone.exists()
