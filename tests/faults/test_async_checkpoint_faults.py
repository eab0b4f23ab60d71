"""checkpoint.async_save in the real app (world 2, tiny model): saves at every step into a tmpfs that
holds two; the third fails in the background writer and surfaces as one line at a later step, the run
trains on (checkpoint.on_error=continue), the two sealed checkpoints stay, nothing partial is left, and
each save's blocked and write seconds reach TensorBoard.  SIGTERM with a save in flight seals it first;
SIGKILL of one worker while the writer is inside a shard file leaves the previous checkpoint the newest
good one, and the next run removes the partial save and resumes from it."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from deepshard.core.checkpoint.manifest import latest_good, step_dirs, verify_checkpoint
from deepshard.core.checkpoint.retention import temp_dirs
from deepshard.launch.failed_group_stop import FAILED_GROUP_GRACE_S
from tests.app_runner import run_main
from tests.finetune_app.app_harness import TINY, scalars

pytestmark = pytest.mark.slow


def test_async_saves_into_a_filling_disk_keep_the_sealed_ones(tmp_path, mount_tmpfs):
    disk = mount_tmpfs("12m")  # two checkpoints of ~4 MB fit, the third does not
    run = tmp_path / "run"
    args = [*TINY, "train.max_steps=5", "checkpoint.every_steps=1", "checkpoint.async_save=true",
            "checkpoint.on_error=continue", f"checkpoint.dir={disk}", f"hydra.run.dir={run}"]
    proc = run_main(args, cwd=tmp_path, timeout=180, env=dict(os.environ, PYTHONUNBUFFERED="1"))  # nothing signals it
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"checkpoint.dir={disk}: saving step 3 failed: needs " in out and " MB free" in out, out[-3000:]
    assert "training on (checkpoint.on_error=continue)" in out and "step     5" in out
    assert "the final save (step 5) failed" in out
    assert [c.step for c in step_dirs(disk)] == [2, 1] and temp_dirs(disk) == []
    assert sorted(p.name for p in disk.iterdir()) == ["step-00000001", "step-00000002"]
    for c in step_dirs(disk):
        verify_checkpoint(c.path)
    assert latest_good(disk)[0] == disk / "step-00000002"
    assert "training blocked" in out and "writing in the background" in out
    tb = scalars(run / "tensorboard")
    assert len(tb["checkpoint/blocked_s"]) == len(tb["checkpoint/write_s"]) == 2
    assert all(b < w for b, w in zip(tb["checkpoint/blocked_s"], tb["checkpoint/write_s"]))


def test_sigterm_with_an_async_save_in_flight_seals_it_then_saves_the_final_one(tmp_path):
    """The writer of step 4 pauses with its shards written (training goes on); SIGTERM then: the run waits
    for step 4 to be sealed, writes the final checkpoint of the step it stopped at, and exits 0."""
    from tests.faults.test_checkpoint_faults import PAUSED, Live

    run = tmp_path / "run"
    app = Live(tmp_path, run, "checkpoint.every_steps=2", "checkpoint.async_save=true", "checkpoint.keep_last=0",
               "train.max_steps=200", env={"DEEPSHARD_FAULT_SAVE_STALL": "4:3"})
    app.wait_for(PAUSED, timeout=120)
    app.kill(signal.SIGTERM)
    code, out = app.finish(timeout=60)
    assert code == 0, out[-3000:]
    assert "preempted" in out and "step 4 sealed" in out
    root = run / "checkpoints"
    steps = [c.step for c in step_dirs(root)]
    assert 4 in steps and 4 < steps[0] <= 8, steps
    for c in step_dirs(root):
        verify_checkpoint(c.path)
    assert temp_dirs(root) == []
    assert f"saved {root / f'step-{steps[0]:08d}'}; exiting" in out


def test_sigkill_of_a_worker_mid_shard_keeps_the_previous_and_the_next_run_resumes_from_it(tmp_path):
    """Both writers pause inside their shard file of step 4 (DEEPSHARD_FAULT_SAVE_STALL=4:120:shard: the
    file open, its first tensor written), training goes on; rank 1 is then killed with SIGKILL.  The job
    ends with the launcher's one line; step 2 stays the newest good checkpoint; step 4 is a partial temp
    dir that no resume takes, and the next run (resume=auto) removes it, saying so, and resumes from 2."""
    from tests.faults.test_checkpoint_faults import PAUSED, Live, _run

    run = tmp_path / "run"
    root = run / "checkpoints"
    app = Live(tmp_path, run, "checkpoint.every_steps=2", "checkpoint.async_save=true", "checkpoint.keep_last=0",
               "train.max_steps=200", env={"DEEPSHARD_FAULT_SAVE_STALL": "4:120:shard"})
    app.wait_for(PAUSED + " (shard)", timeout=120)
    pid = int(json.loads((run / "heartbeat" / "rank1.json").read_text())["pid"])
    partial = [p for p, _, _ in temp_dirs(root)]
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    code, out = app.finish(timeout=60)
    # the job ends at once when rank 0 is in a collective with the dead rank; when the kill comes late
    # (a busy host) rank 0 already waits for its own paused writer (120 s), and the launcher kills it
    # FAILED_GROUP_GRACE_S after the death (torch's own grace was 30 s): either way long before the
    # writer would have finished
    assert code == 1 and time.monotonic() - start < FAILED_GROUP_GRACE_S + 15, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("error: rank 1 died with SIGKILL"), out[-3000:]
    # what the kill left: step 2 sealed and good, step 4 a temp dir with a shard begun and no DCP metadata
    assert [c.step for c in step_dirs(root)] == [2]
    verify_checkpoint(root / "step-00000002")
    assert latest_good(root)[0] == root / "step-00000002"
    (left,) = [p for p, _, _ in temp_dirs(root)]
    assert left in partial and left.name.startswith("step-00000004.tmp-")
    assert list(left.glob("*.distcp")) and not (left / ".metadata").exists()

    code, out = _run(tmp_path, run, "checkpoint.every_steps=2", "train.max_steps=5")
    assert code == 0, out[-3000:]
    assert f"{left.name} is an unfinished save of a dead run" in out and "skipped and removed" in out, out[-3000:]
    assert f"resumed from {root / 'step-00000002'} at step 2" in out
    assert not left.exists() and temp_dirs(root) == []
    assert [c.step for c in step_dirs(root)][0] == 5
    for c in step_dirs(root):
        verify_checkpoint(c.path)
