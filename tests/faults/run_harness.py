"""What the fault tests share: the app's tiny model, a wait for a step's log line, app jobs that are
always stopped, and a job's heartbeats."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAIN = ROOT / "apps/finetune/main.py"
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "data.seq_len=64", "train.log_every=1", "optim.lr=0.01", "data.num_docs=600"]


def wait_for_step(proc: subprocess.Popen, step: int, timeout: float = 120) -> str:
    """stdout up to the log line of ``step`` (rank 0 logs every step); a silent hang is killed at ``timeout``."""
    seen = ""
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    try:
        for line in proc.stdout:
            seen += line
            if re.search(rf"step\s+{step}\s+loss", line):
                return seen
    finally:
        timer.cancel()
    raise AssertionError(f"the run ended before step {step}: {seen[-2000:]}{proc.stderr.read()[-2000:]}")


@contextlib.contextmanager
def jobs() -> Iterator[Callable[..., subprocess.Popen]]:
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


class Drained:
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


def beats(run_dir: Path) -> dict[str, int]:
    """A job's heartbeat files, name -> the pid of the worker that writes it."""
    return {p.name: int(json.loads(p.read_text())["pid"]) for p in sorted((run_dir / "heartbeat").glob("rank*.json"))}


HANG_S = 6


@dataclass
class StoppedJob:
    """What the run and the test's probes left: the refused second jobs, then the hang."""

    first: Path  # the running job's run dir
    third: Path  # the run dir of the job refused on the first one's checkpoint dir
    pid: int  # the running job's launcher
    beats: dict[str, int]  # its heartbeats once it trained, file -> worker pid
    beats_after: dict[str, int]  # and once the second jobs were refused
    alive_after: bool  # still running once they were refused
    refused: dict[str, tuple[int, str, str, float]]  # key -> (exit code, stdout, stderr, seconds)
    code: int  # the job's exit code after rank 1 was stopped
    err: str  # its stderr
    elapsed: float  # seconds from the SIGSTOP to its end


def run_stopped_job(tmp: Path) -> StoppedJob:
    """A job (world 2, ``launcher.hang_s`` 6) at step 3; a second job on its run dir and a third on its
    checkpoint dir are started and refused; then its rank 1 is SIGSTOPped and its watchdog names it."""
    first, third = tmp / "first", tmp / "third"
    refused: dict[str, tuple[int, str, str, float]] = {}
    with jobs() as start:
        job = start(first, "train.max_steps=100000", f"launcher.hang_s={HANG_S}")
        wait_for_step(job, 3)
        drained = Drained(job)
        before = beats(first)
        others = {"hydra.run.dir": start(first, "train.max_steps=3"),
                  "checkpoint.dir": start(third, "train.max_steps=3", f"checkpoint.dir={first / 'checkpoints'}")}
        for key, proc in others.items():
            t0 = time.monotonic()
            try:
                out, err = proc.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{key}: the second job was not refused; it runs alongside the first") from None
            refused[key] = (proc.returncode, out, err, time.monotonic() - t0)
        after, alive = beats(first), job.poll() is None
        os.kill(before["rank1.json"], signal.SIGSTOP)
        t0 = time.monotonic()
        err = drained.wait(timeout=120)
        elapsed = time.monotonic() - t0
    return StoppedJob(first, third, job.pid, before, after, alive, refused, job.returncode, err, elapsed)
