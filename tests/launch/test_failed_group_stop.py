"""A failed worker group's survivors are SIGKILLed FAILED_GROUP_GRACE_S after torchelastic's SIGTERM,
not torch's fixed 30 s (deepshard.launch.failed_group_stop): a launch whose rank 1 dies while rank 0
ignores SIGTERM and waits on something of its own ends within seconds, naming rank 1."""

from __future__ import annotations

import inspect
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.multiprocessing.spawn import ProcessContext

from deepshard.launch import failed_group_stop
from deepshard.launch.failed_group_stop import FAILED_GROUP_GRACE_S, stop_failed_groups_within
from deepshard.launch.local import JobFailed, launch_local


def _one_dies_one_is_stuck(flag_dir: str) -> None:
    rank = int(os.environ["RANK"])
    ready = Path(flag_dir) / "rank0-ignores-sigterm"
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stuck in something of its own: only SIGKILL ends it
        ready.write_text("")
        time.sleep(120)
    else:
        while not ready.exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)


def test_torch_still_closes_a_failed_group_through_pcontext_close():
    # if this fails, torch changed how it stops a failed group's survivors: see failed_group_stop.py
    assert stop_failed_groups_within()
    close, join = failed_group_stop.replaced["close"], failed_group_stop.replaced["join"]
    assert close.__module__ == "torch.distributed.elastic.multiprocessing.api" and PContext.close is not close
    assert join.__module__ == "torch.multiprocessing.spawn" and ProcessContext.join is not join
    assert inspect.signature(close).parameters["timeout"].default == 30  # what a failed group got
    assert inspect.signature(join).parameters["grace_period"].default is None  # 30 s there


def test_only_the_default_grace_changes():
    stop_failed_groups_within()
    calls = []
    context = SimpleNamespace(_close=lambda death_sig, timeout: calls.append((death_sig, timeout)), _tail_logs=[],
                              filtered_stdout=None, filtered_stderr=None)
    PContext.close(context)  # as a context's _poll calls it on a failure
    PContext.close(context, signal.SIGINT, 30)  # as the agent's shutdown calls it, with its own grace
    assert calls == [(signal.SIGTERM, FAILED_GROUP_GRACE_S), (signal.SIGINT, 30)]


@pytest.mark.slow
def test_a_stuck_survivor_of_a_dead_rank_ends_the_job_in_seconds(tmp_path):
    start = time.monotonic()
    with pytest.raises(JobFailed) as failed:
        launch_local(_one_dies_one_is_stuck, 2, str(tmp_path), threads_per_worker=1)
    seconds = time.monotonic() - start
    assert str(failed.value) == "rank 1 died with SIGKILL", str(failed.value)
    assert seconds < FAILED_GROUP_GRACE_S + 10, seconds  # torch's own grace: 30 s
