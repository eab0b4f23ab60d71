"""The policies behind the fault messages, on plain inputs: which bad steps stop a run, which rank a
hang blames, which failure of a crashed job is its cause (the real processes: tests/faults/)."""

from __future__ import annotations

import json
import signal
from types import SimpleNamespace

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from deepshard.finetune.recipe.divergence import DivergenceGuard, TrainingDiverged
from deepshard.launch.heartbeat import Heartbeat, find_hang, read_beats
from deepshard.launch.local import job_failed

NAN = float("nan")


def _guard(dynamic: bool, said: list[str], **kw) -> DivergenceGuard:
    args = {"max_bad_steps": 3, "dynamic": dynamic, "min_scale": 1.0, "scale_window": 4, **kw}
    return DivergenceGuard(**args, say=said.append)


def test_fp32_bad_steps_warn_reset_on_a_good_step_and_stop_at_the_limit():
    said: list[str] = []
    g = _guard(False, said)
    g.check(1, 7.5, applied=True, loss_scale=1.0, newest_checkpoint="ck1")
    g.check(2, NAN, applied=False, loss_scale=1.0, newest_checkpoint="ck1")
    g.check(3, 8.0, applied=False, loss_scale=1.0, newest_checkpoint="ck1")  # finite loss, inf grads
    assert not g.saving_allowed and g.skipped == 2 and len(said) == 2
    assert "non-finite loss and gradient norm" in said[0] and "non-finite gradient norm" in said[1]
    g.check(4, 7.0, applied=True, loss_scale=1.0, newest_checkpoint="ck1")  # recovers: the count restarts
    assert g.saving_allowed
    g.check(5, NAN, applied=True, loss_scale=1.0, newest_checkpoint="ck4")  # applied, but the loss is nan
    g.check(6, NAN, applied=False, loss_scale=1.0, newest_checkpoint="ck4")
    with pytest.raises(TrainingDiverged) as err:
        g.check(7, NAN, applied=False, loss_scale=1.0, newest_checkpoint="ck4")
    msg = str(err.value)
    assert msg.startswith("training diverged at step 7: 3 consecutive steps") and "\n" not in msg
    assert "last finite loss 7.0000 at step 4" in msg and "newest good checkpoint: ck4;" in msg


def test_fp16_dynamic_overflows_are_counted_and_a_scale_stuck_at_min_is_an_error():
    said: list[str] = []
    g = _guard(True, said)
    for step, scale in enumerate([65536.0, 32768.0, 16384.0], 1):  # routine: the scaler backs off
        g.check(step, NAN if step == 2 else 7.0, applied=False, loss_scale=scale, newest_checkpoint="none")
    assert g.skipped == 3 and g.saving_allowed and "(3 skipped so far)" in said[-1]
    g.check(4, 6.9, applied=True, loss_scale=8192.0, newest_checkpoint="none")
    for step in range(5, 8):  # at the floor but fewer than the window (4)
        g.check(step, 7.0, applied=False, loss_scale=1.0, newest_checkpoint="none")
    g.check(8, 6.8, applied=True, loss_scale=1.0, newest_checkpoint="none")  # a clean step resets it
    for step in range(9, 12):
        g.check(step, 7.0, applied=False, loss_scale=1.0, newest_checkpoint="none")
    with pytest.raises(TrainingDiverged, match=r"stuck at precision.min_loss_scale=1 .* for 4 steps"):
        g.check(12, 7.0, applied=False, loss_scale=1.0, newest_checkpoint="none")


def _beat(rank, step, phase, since, beat):
    return {"rank": rank, "pid": 100 + rank, "step": step, "phase": phase, "since": since, "beat": beat}


def test_a_hang_blames_the_rank_that_stopped_beating_not_the_one_waiting_for_it():
    now = 1000.0
    waiting = _beat(0, 12, "optimizer", since=now - 40, beat=now - 0.3)  # blocked in a collective, alive
    stopped = _beat(1, 12, "backward", since=now - 41, beat=now - 40)  # SIGSTOP
    assert find_hang([waiting, stopped], 30, now).rank == 1
    assert str(find_hang([waiting, stopped], 30, now)) == "rank 1 has made no progress since step 12 (backward) for 41 s"
    assert find_hang([waiting, stopped], 60, now) is None  # not yet
    # the race the launch tests met: the waiter stalled (since 31 s) before the stopped rank's last beat
    # (25 s ago, < hang_s) is hang_s old, and the waiter is further behind: the silent beat still decides
    early_waiter = _beat(0, 71, "backward", since=now - 31, beat=now - 0.3)
    just_stopped = _beat(1, 71, "optimizer", since=now - 26, beat=now - 25)
    assert find_hang([early_waiter, just_stopped], 30, now).rank == 1
    # both alive (a rank looping in Python): the one behind is blamed
    looping = _beat(1, 12, "forward", since=now - 35, beat=now - 0.2)
    assert find_hang([waiting, looping], 30, now).rank == 1
    # loading before the first step is not judged while the process beats; done ranks never
    loading = [_beat(0, 0, "startup", since=now - 500, beat=now), _beat(1, 9, "done", since=now - 500, beat=now - 500)]
    assert find_hang(loading, 30, now) is None


def test_a_save_that_writes_is_progress_of_every_rank_one_that_writes_nothing_is_a_hang():
    now = 1000.0
    saving = _beat(0, 6, "checkpoint", since=now - 40, beat=now - 0.3) | {"wrote": now - 1}  # a slow writer
    waiting = _beat(1, 6, "checkpoint", since=now - 38, beat=now - 0.2) | {"wrote": now - 39}  # its shard done
    assert find_hang([saving, waiting], 30, now) is None  # the save writes: no rank is hung
    silent = saving | {"wrote": now - 35}  # the writer stopped writing 35 s ago
    assert str(find_hang([silent, waiting], 30, now)) == "rank 0 has made no progress since step 6 (checkpoint) for 35 s"


def test_save_progress_reaches_the_heartbeat_through_cores_seam(tmp_path):
    from deepshard.core.checkpoint import progress

    beat = Heartbeat(str(tmp_path), rank=0, interval_s=0.05)
    previous = progress.set_listener(beat.progress)
    try:
        progress.report(100)
        progress.report(23)
    finally:
        progress.set_listener(previous)
    progress.report(1)  # no listener: nobody hears it
    beat._write()
    (state,) = read_beats(tmp_path)
    assert state["wrote_bytes"] == 123 and state["wrote"] >= state["since"]
    beat.close()


def test_heartbeat_files_carry_step_and_phase(tmp_path):
    beat = Heartbeat(str(tmp_path), rank=3)
    beat.mark("backward", 7)
    (state,) = read_beats(tmp_path)
    assert (state["rank"], state["step"], state["phase"]) == (3, 7, "backward")
    beat.close()
    assert read_beats(tmp_path)[0]["phase"] == "done"
    Heartbeat(None, rank=0).mark("forward", 1)  # no directory: a no-op


def _failure(exitcode: int, message: str = "", timestamp: int = 0):
    sig = signal.Signals(-exitcode).name if exitcode < 0 else ""
    data = {"message": {"message": message, "extraInfo": {"py_callstack": f"Traceback\n{message}"}}} if message else {}
    return SimpleNamespace(exitcode=exitcode, error_file_data=data, timestamp=timestamp, signal_name=lambda: sig)


def test_the_cause_of_a_crashed_job_is_the_killed_or_raising_rank_not_its_peers():
    killed = SimpleNamespace(failures={0: _failure(1, "DistBackendError: Connection closed by peer", 5),
                                       1: _failure(-signal.SIGKILL, timestamp=6)})
    err = job_failed(killed, beats=[_beat(1, 12, "backward", 0, 0)])
    assert (str(err), err.rank, err.kind) == ("rank 1 died with SIGKILL during step 12 (backward)", 1, "signal")
    raised = SimpleNamespace(failures={0: _failure(1, "RuntimeError: [gloo] Connection reset by peer", 4),
                                       1: _failure(1, "ValueError: bad row 3", 5)})
    err = job_failed(raised)
    assert (str(err), err.error_type, sorted(err.tracebacks)) == ("rank 1: ValueError: bad row 3", "ValueError", [0, 1])
    terminated = SimpleNamespace(failures={0: _failure(-signal.SIGTERM, timestamp=1), 1: _failure(1, "KeyError: 'x'", 2)})
    assert str(job_failed(terminated)) == "rank 1: KeyError: 'x'"


def test_a_raising_rank_that_the_launcher_did_not_report_is_found_by_its_error_file(tmp_path):
    """torchelastic reports only the first process to exit: the peer that lost its connection.  The rank
    that raised left its error file (torchelastic's own layout) and is named as the cause."""
    for rank, message in ((0, "RuntimeError: [gloo] Connection closed by peer"), (1, "ValueError: bad row 3")):
        (tmp_path / "attempt_0" / str(rank)).mkdir(parents=True)
        (tmp_path / "attempt_0" / str(rank) / "error.json").write_text(json.dumps(
            {"message": {"message": message, "extraInfo": {"py_callstack": "Traceback", "timestamp": "5"}}}))
    first = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(tmp_path / "attempt_0/0/error.json"))
    err = job_failed(SimpleNamespace(failures={0: first}))
    assert (str(err), err.rank, err.error_type) == ("rank 1: ValueError: bad row 3", 1, "ValueError")
