"""Issue 45: what ``.deepshard.lock`` (and the launcher's other files in a run dir) may be, and whose a
lock record is.  A planted symlink, directory or FIFO is refused with one line and left alone (a link
was followed: its target overwritten); a record counts as alive only while its very process runs (pid
and start time: a reused pid, this process's own included, is a dead owner); a record of the same job
(a restart, from any host) is no rival.  Single process: real links, a real FIFO, real records."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from deepshard.launch.heartbeat import Heartbeat, remove_dead_beats
from deepshard.launch.local import _elastic_logs_to
from deepshard.launch.run_lock import LOCK_NAME, DirectoryInUse, acquire


def _refusal(path, kind: str) -> str:
    return rf"^{re.escape(str(path))}: is {kind}, not a regular file; "


def test_a_lock_path_that_is_a_link_a_directory_or_a_fifo_is_refused_and_left_alone(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).symlink_to(target)
    with pytest.raises(ValueError, match=_refusal(run / LOCK_NAME, "a symlink")) as err:
        acquire(run, key="hydra.run.dir")
    assert "\n" not in str(err.value)
    assert target.read_text() == "keep me\n" and (run / LOCK_NAME).is_symlink()  # not written, not removed
    (tmp_path / "d" / LOCK_NAME).mkdir(parents=True)
    with pytest.raises(ValueError, match=_refusal(tmp_path / "d" / LOCK_NAME, "a directory")):
        acquire(tmp_path / "d", key="checkpoint.dir")
    (tmp_path / "f").mkdir()
    os.mkfifo(tmp_path / "f" / LOCK_NAME)
    with pytest.raises(ValueError, match=_refusal(tmp_path / "f" / LOCK_NAME, "a FIFO")):
        acquire(tmp_path / "f", key="checkpoint.dir")


def test_launcher_log_and_heartbeats_are_never_written_through_a_link(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    (tmp_path / "launcher.log").symlink_to(target)
    with pytest.raises(ValueError, match=_refusal(tmp_path / "launcher.log", "a symlink")), \
            _elastic_logs_to(str(tmp_path / "launcher.log")):
        logging.getLogger("torch.distributed.elastic").error("a worker failed")
    (tmp_path / "rank0.json").symlink_to(target)
    with pytest.raises(ValueError, match=_refusal(tmp_path / "rank0.json", "a symlink")):
        Heartbeat(str(tmp_path), 0)
    os.mkfifo(tmp_path / "rank1.json")  # opened for writing, a FIFO without a reader would block forever
    with pytest.raises(ValueError, match=_refusal(tmp_path / "rank1.json", "a FIFO")):
        Heartbeat(str(tmp_path), 1)
    assert target.read_text() == "keep me\n"


def _record(directory, **fields) -> None:
    now = time.time()
    record = {"host": socket.gethostname(), "started": now - 100, "renewed": now - 1, "job": "killed", **fields}
    (directory / LOCK_NAME).write_text(json.dumps(record))


def _start_time(pid: int) -> str:
    """How a lock record names one process: the boot, and /proc/PID/stat's field 22 (start time in ticks)."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{boot}/{Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[19]}"


def _takeovers(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]


def test_a_record_whose_pid_now_belongs_to_another_process_is_a_dead_owner(tmp_path, caplog):
    """After a container restart the dead job's pid can be this launcher's own, or another live
    process's: renewed a second ago, its record is still taken over, as its process is not the one
    that runs under that pid now (another start time, or none recorded and the pid is our own)."""
    caplog.set_level(logging.INFO)
    other = subprocess.Popen(["sleep", "60"])
    try:
        for pid, process in ((os.getpid(), None), (os.getpid(), "another-boot/12345"), (other.pid, "another-boot/1")):
            _record(tmp_path, pid=pid, **({} if process is None else {"process": process}))
            with acquire(tmp_path, key="checkpoint.dir", job="new") as lock:
                assert lock.owner.pid == os.getpid()
            assert f"took over the lock of a deepshard job that is gone (pid {pid} " in _takeovers(caplog)[-1]
        assert len(_takeovers(caplog)) == 3
        _record(tmp_path, pid=other.pid, process=_start_time(other.pid))
        with pytest.raises(DirectoryInUse, match=rf"\(pid {other.pid} on host "):  # its very process runs
            acquire(tmp_path, key="checkpoint.dir", job="new")
    finally:
        other.kill()
        other.wait()


def test_a_heartbeat_whose_pid_now_belongs_to_another_process_is_an_earlier_runs(tmp_path):
    """The same for the launcher's heartbeat files: one of a reused pid is removed, not taken for another
    job's live rank (which refused the launch, and whose pid a watchdog could kill)."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        for rank, process in ((0, "another-boot/1"), (1, _start_time(other.pid))):
            (tmp_path / f"rank{rank}.json").write_text(json.dumps(
                {"rank": rank, "pid": other.pid, "step": 3, "phase": "forward", "since": time.time(), "marks": 5,
                 "beat": time.time(), "host": socket.gethostname(), "process": process}))
        assert [f.name for f, _ in remove_dead_beats(tmp_path)] == ["rank1.json"]
        assert not (tmp_path / "rank0.json").exists()
    finally:
        other.kill()
        other.wait()


def test_the_jobs_own_record_from_another_host_is_no_rival(tmp_path, caplog):
    """Under --max_restarts c10d may put global rank 0 on another node: the lock its previous attempt
    renewed seconds ago there is this job's own (the job field, torchelastic's run id)."""
    caplog.set_level(logging.INFO)
    _record(tmp_path, host="node-b", pid=4242, job="c10d-run-7")
    with acquire(tmp_path, key="checkpoint.dir", job="c10d-run-7") as lock:
        assert (lock.owner.host, lock.owner.job) == (socket.gethostname(), "c10d-run-7")
    assert "took over the lock of this job's earlier attempt (pid 4242 on host node-b" in _takeovers(caplog)[-1]
    for job in ("another-job", "none"):  # torchrun's default run id names no job
        _record(tmp_path, host="node-b", pid=4242, job=job)
        with pytest.raises(DirectoryInUse, match=r"\(pid 4242 on host node-b, "):
            acquire(tmp_path, key="checkpoint.dir", job=job if job == "none" else "c10d-run-7")
