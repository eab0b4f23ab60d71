"""Real DeepSpeed checkpoints for tests/compat (ZeRO-1/2/3, world 2, a tiny HF Llama), with
DeepSpeed's own next 3 losses after resuming from them, so CI compares without DeepSpeed.

    pip install -r bench/requirements.txt    # the bench extra: DeepSpeed 0.19.x
    python bench/make_ds_checkpoints.py [--out tests/compat/fixtures]

Each ``ds_zeroN/`` holds ``checkpoint/`` (``latest``, ``global_step3/mp_rank_00_model_states.pt``,
``*zero_pp_rank_*_optim_states.pt``) and ``continuation.json`` (the config, DeepSpeed's losses for
steps 1-3 and, after ``load_checkpoint`` in a fresh engine, steps 4-6: the mean over ranks of each
rank's micro-batch loss, i.e. the global batch's mean loss since every row has the same length).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.* and tests.* by package path

from tests.compat.ds_fixture_model import (  # noqa: E402
    SAVE_STEP,
    TOTAL_STEPS,
    ds_config,
    param_groups,
    tiny_model,
    train_steps,
)


def _losses(engine, steps: range) -> list[float]:
    """The fixture loop shared with the tests (this script runs at world 2, where its rows are MICRO)."""
    return train_steps(engine, steps, torch.distributed.get_rank(), torch.distributed.get_world_size())


def worker(stage: int, out_dir: str) -> dict:
    sys.stdout.flush()
    os.dup2(2, 1)  # DeepSpeed's banners go to stderr
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = tiny_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=ds_config(stage))
    before = _losses(engine, range(SAVE_STEP))
    ckpt = Path(out_dir) / "checkpoint"
    engine.save_checkpoint(str(ckpt), tag=f"global_step{SAVE_STEP}")
    torch.distributed.barrier()
    fresh_model = tiny_model(seed=1)  # different weights: everything must come from the checkpoint
    fresh, *_ = deepspeed.initialize(model=fresh_model, model_parameters=param_groups(fresh_model),
                                     config=ds_config(stage))
    path, _ = fresh.load_checkpoint(str(ckpt))
    assert path is not None
    after = _losses(fresh, range(SAVE_STEP, TOTAL_STEPS))
    return {"before": before, "after": after, "version": deepspeed.__version__}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "tests" / "compat" / "fixtures"))
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()
    from deepshard.launch.local import launch_local

    for stage in args.stages:
        out = Path(args.out) / f"ds_zero{stage}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        results = launch_local(worker, 2, stage, str(out))
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed copies its recovery script in
            (out / "checkpoint" / script).unlink(missing_ok=True)
        r = results[0]
        record = {"deepspeed": r["version"], "world_size": 2, "zero_stage": stage, "config": ds_config(stage),
                  "save_step": SAVE_STEP, "losses_before": r["before"], "losses_after_resume": r["after"]}
        (out / "continuation.json").write_text(json.dumps(record, indent=1) + "\n")
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"{out}: {size / 1e3:.0f} KB, DeepSpeed's losses after resume {r['after']}")


if __name__ == "__main__":
    main()
