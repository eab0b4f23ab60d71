"""``deepshard apps/finetune/main.py`` with --max_restarts: a worker SIGKILLed at step 6 of 8
(checkpoints every 4 steps) is restarted, the app resumes from step 4 and logs the losses of an
uninterrupted run of the app's own workers, bit for bit (fp32); a failure that repeats at the same step stops once the restarts are used up,
naming the step.  The same for a DeepSpeed script on deepshard.compat (``load_checkpoint`` of
``latest`` at start, a save every 4 steps): SIGKILL at step 6 of 8, resumed from step 4, the
uninterrupted run's losses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.launch.compat_runs import final_losses, run_loop

pytestmark = pytest.mark.slow

MAIN = Path(__file__).resolve().parents[2] / "apps" / "finetune" / "main.py"
# the app's tiny model (a smaller one than its default: what is checked is the restart, not the model)
RUN = ["+zero=stage3", "train.max_steps=8", "checkpoint.every_steps=4", "train.log_every=1", "model.dim=64",
       "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128", "data.seq_len=64",
       "data.num_docs=600"]


def launch(argv, cwd, env, on_start=None, timeout=240):
    proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        if on_start is not None:
            on_start(proc)
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def losses(run_dir: Path) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tag = next(t for t in acc.Tags()["scalars"] if t.endswith("loss") and "eval" not in t)
    return {e.step: e.value for e in acc.Scalars(tag)}


def kill_rank_at(beat_dir: Path, rank: int, step: int, stop: threading.Event, killed: list) -> None:
    """SIGKILL ``rank`` once its heartbeat says it reached ``step`` (first attempt only)."""
    path = beat_dir / f"rank{rank}.json"
    while not stop.wait(0.02):
        try:
            beat = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if beat["step"] >= step and beat["phase"] != "startup":
            os.kill(int(beat["pid"]), signal.SIGKILL)
            killed.append(beat["step"])
            return


def test_restart_resumes_from_the_last_checkpoint_bit_exact(tmp_path, whole_app_losses):
    beat_dir = tmp_path / "beats"
    beat_dir.mkdir()
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=kill_rank_at, args=(beat_dir, 1, 6, stop, killed), daemon=True)
    try:
        code, out, err = launch(["deepshard", "--max_restarts=1", str(MAIN), *RUN, f"hydra.run.dir={tmp_path / 'cut'}"],
                                tmp_path, {"DEEPSHARD_HEARTBEAT_DIR": str(beat_dir)}, on_start=lambda p: watcher.start())
    finally:
        stop.set()
    assert code == 0, err[-3000:]
    assert killed and killed[0] in (6, 7), killed
    assert "a worker on" in err and "restarting the workers (restart 1 of 1)" in err
    assert "resumed from" in err + out and "step-00000004 at step 4" in err + out
    whole, cut = whole_app_losses, losses(tmp_path / "cut")  # the oracle: the app's own 2 local workers, uninterrupted
    assert sorted(whole) == sorted(cut) == list(range(1, 9))  # steps 1-6 from the first attempt, 5-8 resumed
    assert [cut[s] for s in range(1, 9)] == [whole[s] for s in range(1, 9)]  # fp32: bit for bit


def test_a_failure_that_repeats_stops_after_the_restarts_naming_the_step(tmp_path):
    start = time.time()
    code, _, err = launch(["deepshard", "--max_restarts=1", str(MAIN), *RUN, f"hydra.run.dir={tmp_path / 'r'}"],
                          tmp_path, {"DEEPSHARD_TEST_FAULT": "error@6"})
    assert code != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 on ") and "injected test fault at step 6" in last, err[-2000:]
    assert last.endswith("(after 1 restart(s): --max_restarts used up)")
    assert err.count("restarting the workers") == 1
    print(f"repeating failure ended after {time.time() - start:.0f} s")


def test_a_deepspeed_script_resumes_from_latest_after_a_restart(tmp_path, one_node_losses):
    code, err, rows = run_loop(["--num_gpus=2", "--max_restarts=1"], tmp_path / "cut", loop_args=("--die_at", "1:6"))
    assert code == 0, err[-3000:]
    assert err.count("restarting the workers (restart 1 of 1)") == 1, err[-3000:]
    resumed = [line for line in err.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and "global_step4" in resumed[0] and resumed[0].endswith(" at step 4"), err[-3000:]
    first, second = ([r for r in rows if r["attempt"] == a] for a in (0, 1))
    assert max(r["step"] for r in first if r["rank"] == 1) == 5  # rank 1 died before step 6
    assert sorted({r["step"] for r in second}) == list(range(5, 9))  # resumed after step 4
    assert all(one_node_losses[(r["rank"], r["step"])] == r["loss"] for r in first)
    assert final_losses(rows) == one_node_losses  # fp32: bit for bit


HF_LOOP = Path(__file__).resolve().with_name("hf_trainer_loop.py")


def test_an_hf_trainer_script_resumes_from_its_checkpoint_after_a_restart(tmp_path):
    from tests.launch.compat_runs import DEEPSHARD
    from tests.launch.compat_runs import launch as run

    def job(name: str, *flags: str, script_args: tuple[str, ...] = ()) -> tuple[str, dict]:
        out = tmp_path / f"{name}.json"
        code, _, err = run([*DEEPSHARD, "--num_gpus=2", *flags, str(HF_LOOP), "--output_dir", str(tmp_path / name),
                            "--out", str(out), *script_args], tmp_path)
        assert code == 0, err[-3000:]
        return err, json.loads(out.read_text())

    # the uninterrupted run first, in the same workers (hf_trainer_loop's --whole_first): one launch, not two
    err, cut = job("cut", "--max_restarts=1", script_args=("--die_at", "1:6", "--whole_first", str(tmp_path / "whole")))
    whole = json.loads((tmp_path / "whole.json").read_text())
    assert err.count("restarting the workers (restart 1 of 1)") == 1, err[-3000:]
    resumed = [line for line in err.splitlines() if "resumed from" in line]
    assert len(resumed) == 1 and "/checkpoint-4/global_step4/step-00000004 at step 4" in resumed[0], err[-3000:]
    assert cut["resumed_from"].endswith("checkpoint-4") and whole["resumed_from"] is None
    assert sorted(map(int, cut["losses"])) == list(range(1, 9))
    assert cut["losses"] == whole["losses"]  # fp32 ZeRO-3: bit for bit
