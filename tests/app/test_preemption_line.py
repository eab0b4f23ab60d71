"""The preemption's line on plain inputs: it says "saved step N" only when step N is sealed on disk, and
otherwise what a rerun resumes from; exit 1 only when the workers were killed mid-save (the real signals
and grace: tests/faults/test_slow_saves.py)."""

from __future__ import annotations

from pathlib import Path

from deepshard.core.checkpoint.manifest import FORMAT, describe_files, write_manifest
from deepshard.core.checkpoint.owners import write_owner
from deepshard.finetune.preempted import preemption_outcome


def _sealed(root: Path, step: int) -> Path:
    path = root / f"step-{step:08d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shard" * 10)
    write_manifest(path, {"format": FORMAT, "step": step, "files": describe_files(path, ["__0_0.distcp"])})
    return path


def _beats(step: int, phase: str) -> list[dict]:
    return [{"rank": r, "pid": 1, "step": step, "phase": phase, "since": 0.0, "beat": 0.0} for r in (0, 1)]


def test_saved_only_when_the_step_reached_is_sealed(tmp_path):
    two, four = _sealed(tmp_path, 2), _sealed(tmp_path, 4)
    done = preemption_outcome(tmp_path, _beats(4, "done"), signal_name="SIGTERM", grace_s=30)
    assert not done.cut_short and done.checkpoint == four
    assert done.line == (f"preempted (SIGTERM): saved step 4 ({four}, sealed): rerun with checkpoint.resume=auto "
                         f"to continue from it")

    (four / "__0_0.distcp").write_bytes(b"short")  # truncated: not sealed, whatever its name says
    tmp = tmp_path / "step-00000006.tmp-0123abcd"
    tmp.mkdir()
    write_owner(tmp)
    cut = preemption_outcome(tmp_path, _beats(6, "checkpoint"), signal_name="SIGTERM", grace_s=30)
    assert cut.cut_short and cut.checkpoint == two
    assert cut.line == ("preempted (SIGTERM) at step 6: step 6 was not saved: its save was cut short: the workers "
                        "were killed launcher.shutdown_grace_s=30 s after the signal, with a save unfinished (the "
                        f"partial {tmp.name} is left); a rerun with checkpoint.resume=auto resumes from step 2 "
                        f"({two})")


def test_a_run_that_ended_without_saving_or_before_its_first_step(tmp_path):
    ended = preemption_outcome(tmp_path, _beats(3, "done"), signal_name="SIGINT", grace_s=30)
    assert not ended.cut_short and ended.line == (  # withheld, or a failed save: said by the workers
        "preempted (SIGINT) at step 3: step 3 was not saved: the workers ended without saving it (their log says "
        f"why); a rerun starts at step 0 (no sealed checkpoint under {tmp_path})")
    early = preemption_outcome(tmp_path, _beats(0, "startup"), signal_name="SIGTERM", grace_s=30)
    assert not early.cut_short and early.checkpoint is None
