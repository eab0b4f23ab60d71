"""Two jobs on one directory, with the real app at world 2: a second job on the run dir or on the
checkpoint dir of a running one is refused before it starts anything (one ``error:`` line naming the
directory and the first job's pid, exit 2), and the first one keeps its heartbeats, so its own hang
detection still names its stopped rank; a lock left by a job that died is taken over with a log line.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.run_harness import HANG_S, StoppedJob, jobs

LOCK = ".deepshard.lock"  # deepshard.launch.run_lock.LOCK_NAME, spelled out: the test must run on code without it

pytestmark = pytest.mark.slow


def _refused(stopped: StoppedJob, key: str, directory: Path) -> None:
    code, out, err, _ = stopped.refused[key]
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    assert re.fullmatch(rf"error: {key}={re.escape(str(directory))} is in use by another deepshard job \(pid "
                        rf"{stopped.pid} on host {re.escape(socket.gethostname())}, started [-\d]+ [:\d]+\); wait "
                        r"for it, or use another directory", lines[-1]), err[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in err
    assert "step" not in out  # it trained nothing


def test_a_second_job_on_a_running_jobs_run_or_checkpoint_dir_is_refused_and_the_first_sees_its_hang(stopped_job):
    """tests/faults/conftest.py's run: a job at step 3, the second jobs started on its directories, then
    its rank 1 stopped."""
    first = stopped_job.first
    assert sorted(stopped_job.beats) == ["rank0.json", "rank1.json"]
    _refused(stopped_job, "hydra.run.dir", first)
    _refused(stopped_job, "checkpoint.dir", first / "checkpoints")
    assert not (stopped_job.third / "heartbeat").exists()  # no worker of theirs started
    # the first job's heartbeats are its own, still
    assert stopped_job.beats_after == stopped_job.beats and stopped_job.alive_after

    # and they still serve it: a stopped rank is named by its watchdog, within the hang time
    err = stopped_job.err
    assert stopped_job.code == 1, err[-3000:]
    assert stopped_job.elapsed < 2 * HANG_S + 5, stopped_job.elapsed
    assert re.fullmatch(r"error: rank 1 has made no progress since step \d+ \(\w+\) for \d+ s",
                        err.strip().splitlines()[-1]), err[-3000:]


def test_a_lock_left_by_a_job_that_died_is_taken_over_with_a_log_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    started = time.time() - 600
    (run_dir / LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid, "started": started,
                                            "renewed": started + 590, "job": "run1"}))
    with jobs() as start:
        job = start(run_dir, "train.max_steps=2")
        out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    lines = [line for line in (out + err).splitlines() if "took over" in line]
    assert len(lines) == 1, out[-3000:] + err[-3000:]
    assert (f"hydra.run.dir={run_dir}: took over the lock of a deepshard job that is gone (pid {gone.pid} on host "
            f"{socket.gethostname()}, started ") in lines[0]
    assert re.search(r"step\s+2\s+loss", out)
    assert not (run_dir / LOCK).exists()  # released at the end


def test_a_lock_that_is_a_symlink_is_refused_before_anything_starts(tmp_path):
    """Issue 45: ``run/.deepshard.lock`` linked to a file (a shared or downloaded dir can carry one; the
    app often runs as root) had the job write its lock record into the target and remove the link."""
    run_dir, target = tmp_path / "run", tmp_path / "precious"
    run_dir.mkdir()
    target.write_text("keep me\n")
    (run_dir / LOCK).symlink_to(target)
    with jobs() as start:
        job = start(run_dir, "train.max_steps=2")
        out, err = job.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert job.returncode == 2, err[-3000:]
    assert lines[-1].startswith(f"error: {run_dir / LOCK}: is a symlink, not a regular file; "), err[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in err
    assert target.read_text() == "keep me\n" and (run_dir / LOCK).is_symlink()
    assert not (run_dir / "heartbeat").exists() and "step" not in out  # no worker started
