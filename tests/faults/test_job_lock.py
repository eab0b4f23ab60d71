"""Two jobs on one directory, with the real app at world 2: a second job on the run dir or on the
checkpoint dir of a running one is refused before it starts anything (one ``error:`` line naming the
directory and the first job's pid, exit 2, having written nothing there, not even Hydra's ``.hydra/``),
and the first one keeps its heartbeats, so its own hang
detection still names its stopped rank; a lock left by a job that died is taken over with a log line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.app_runner import run_main
from tests.faults.run_harness import MAIN, ROOT, TINY, wait_for_step

LOCK = ".deepshard.lock"  # deepshard.launch.run_lock.LOCK_NAME, spelled out: the test must run on code without it

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _jobs():
    """Start app runs; whatever happens, every one of them (and its workers, stopped ones too) is killed."""
    procs: list[subprocess.Popen] = []

    def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
        cmd = [sys.executable, str(MAIN), *TINY, *overrides, f"hydra.run.dir={run_dir}"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class _Drained:
    """Reads a running job's output in the background: a full pipe would stall its rank 0 (a hang)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc, self.out, self.err = proc, [], []
        self.threads = [threading.Thread(target=lambda f=f, into=into: into.extend(f), daemon=True)
                        for f, into in ((proc.stdout, self.out), (proc.stderr, self.err))]
        for t in self.threads:
            t.start()

    def wait(self, timeout: float) -> str:
        """stderr once the job ended."""
        self.proc.wait(timeout=timeout)
        for t in self.threads:
            t.join(timeout=10)
        return "".join(self.err)


def _beats(run_dir: Path) -> dict[str, int]:
    return {p.name: int(json.loads(p.read_text())["pid"]) for p in sorted((run_dir / "heartbeat").glob("rank*.json"))}


def _hydra_files(run_dir: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((run_dir / ".hydra").iterdir())}


def _app(run_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A run that nothing signals or stops: through the pytest worker's app runner (tests/app_runner.py)."""
    return run_main([*TINY, *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT, timeout=timeout,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _refused(run_dir: Path, key: str, directory: Path, owner: int, *overrides: str) -> None:
    try:
        proc = _app(run_dir, *overrides, timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{key}={directory}: the second job was not refused; it runs alongside the first") from None
    err = proc.stderr
    lines = err.strip().splitlines()
    assert proc.returncode == 2, err[-3000:]
    assert re.fullmatch(rf"error: {key}={re.escape(str(directory))} is in use by another deepshard job \(pid {owner} "
                        rf"on host {re.escape(socket.gethostname())}, started [-\d]+ [:\d]+\); wait for it, or use "
                        r"another directory", lines[-1]), err[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in err
    assert "step" not in proc.stdout  # it trained nothing


@pytest.mark.alone  # the hang seen within 2 x hang_s + 5 s
def test_a_second_job_on_a_running_jobs_run_or_checkpoint_dir_is_refused_and_the_first_sees_its_hang(tmp_path):
    hang_s = 4  # the test waits this long (alone: the other worker waits too)
    first, third = tmp_path / "first", tmp_path / "third"
    with _jobs() as start:
        job = start(first, "train.max_steps=100000", f"launcher.hang_s={hang_s}")
        wait_for_step(job, 2)
        drained = _Drained(job)
        beats = _beats(first)
        assert sorted(beats) == ["rank0.json", "rank1.json"]
        composed = _hydra_files(first)
        assert "- train.max_steps=100000" in composed["overrides.yaml"], composed
        _refused(first, "hydra.run.dir", first, job.pid, "train.max_steps=3")
        _refused(third, "checkpoint.dir", first / "checkpoints", job.pid, "train.max_steps=3",
                 f"checkpoint.dir={first / 'checkpoints'}")
        assert not (third / "heartbeat").exists()  # no worker of theirs started
        assert _hydra_files(first) == composed  # the refused job wrote nothing into the first's .hydra/
        assert not (third / ".hydra").exists()
        assert _beats(first) == beats and job.poll() is None  # the first job's heartbeats are its own, still

        # and they still serve it: a stopped rank is named by its watchdog, within the hang time
        os.kill(beats["rank1.json"], signal.SIGSTOP)
        t0 = time.monotonic()
        err = drained.wait(timeout=120)
        elapsed = time.monotonic() - t0
    assert job.returncode == 1, err[-3000:]
    assert elapsed < 2 * hang_s + 5, elapsed
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
    job = _app(run_dir, "train.max_steps=2")
    out, err = job.stdout, job.stderr
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
    job = _app(run_dir, "train.max_steps=2")
    out, err = job.stdout, job.stderr
    lines = err.strip().splitlines()
    assert job.returncode == 2, err[-3000:]
    assert lines[-1].startswith(f"error: {run_dir / LOCK}: is a symlink, not a regular file; "), err[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in err
    assert target.read_text() == "keep me\n" and (run_dir / LOCK).is_symlink()
    assert not (run_dir / "heartbeat").exists() and "step" not in out  # no worker started
