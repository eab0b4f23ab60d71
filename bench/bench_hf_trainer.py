"""Step time of the issue-26 test script: deepshard's Trainer against transformers' Trainer on real
DeepSpeed, in the same run (the README's "Coming from the HF Trainer" number).

    pip install -r bench/requirements.txt    # DeepSpeed 0.19.8 for the peer
    python bench/bench_hf_trainer.py [--steps 24] [--stages 2 3]

The script is tests/compat/hf_trainer_harness.py's (tiny Llama, prompt/response rows, the tutorial's
TrainingArguments, the "auto" ds_config) at world 2 (deepshard.launch.local), micro-batch 2 x
accumulation 2 per rank.  ``ours`` is ``deepshard.compat.transformers.Trainer``; ``deepspeed`` is
``transformers.Trainer`` with the same ``deepspeed=`` (accelerate's DeepSpeed plugin, DeepSpeed's
CPU accelerator and gloo on a CPU host; fp32, as DeepSpeed has no fp16 on CPU).  A step's time is
the wall time between consecutive ``on_step_end`` callbacks on rank 0 (one optimizer update, i.e.
2 forward/backward micro-batches and the update); the first ``--warmup`` steps are left out.  Each
side runs ``--repeat`` launches per config, alternating with the other side.  Prints one JSON
object: median and mean step seconds per side and config (and each launch's median), and the
ratio of the medians, ours / DeepSpeed's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.* and tests.* by package path

MICRO, ACCUM, WORLD = 2, 2, 2


def worker(side: str, stage: int, offload: bool, steps: int, out_dir: str) -> dict:
    sys.stdout.flush()
    os.dup2(2, 1)  # DeepSpeed's banners go to stderr
    import transformers

    from tests.compat.hf_trainer_harness import arguments, collate, ds_config, rows, tiny_llama

    if side == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed  # noqa: F401  (fails here, not inside transformers, when the bench extra is missing)

        from bench.record_hf_trainer_ds import accelerate_gloo_on_cpu

        accelerate_gloo_on_cpu()  # accelerate's DeepSpeed state on a CPU host (see there)

        trainer_cls, args_cls = transformers.Trainer, transformers.TrainingArguments
    else:
        from deepshard.compat.transformers import Trainer, TrainingArguments

        trainer_cls, args_cls = Trainer, TrainingArguments
    ends: list[float] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, *_: object, **__: object) -> None:
            ends.append(time.perf_counter())

    args = arguments(args_cls, Path(out_dir), micro=MICRO, accum=ACCUM, max_steps=steps,
                     deepspeed=ds_config(stage, offload=offload), fp16=False, logging_steps=steps)
    trainer = trainer_cls(model=tiny_llama(), args=args, train_dataset=rows(), data_collator=collate,
                          callbacks=[StepClock()])
    trainer.train()
    return {"step_s": [b - a for a, b in zip(ends, ends[1:])]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--repeat", type=int, default=2, help="launches per side and config, alternating")
    opts = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger prints to stdout: keep it JSON only
        import deepspeed
    import torch
    import transformers

    from deepshard.launch.local import launch_local

    configs = {2: ("zero2", False), 3: ("zero3_offload", True)}
    out: dict = {"script": "tests/compat/hf_trainer_harness.py", "world_size": WORLD, "micro_batch": MICRO,
                 "gradient_accumulation_steps": ACCUM, "steps": opts.steps, "warmup_steps_dropped": opts.warmup, "launches_per_side": opts.repeat,
                 "precision": "fp32", "host": f"{os.cpu_count()} CPUs, gloo",
                 "versions": {"deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
                              "torch": torch.__version__}, "configs": {}}
    for stage in opts.stages:
        name, offload = configs[stage]
        kept: dict[str, list[list[float]]] = {"ours": [], "deepspeed": []}
        for _ in range(opts.repeat):  # alternate the sides so a busy moment on the host hits both
            for side in kept:
                with tempfile.TemporaryDirectory() as tmp:
                    step_s = launch_local(worker, WORLD, side, stage, offload, opts.steps, tmp)[0]["step_s"]
                kept[side].append(step_s[max(0, opts.warmup - 1):])  # step_s[i] is step i+2's time
        row: dict = {}
        for side, launches in kept.items():
            every = [t for launch in launches for t in launch]
            row[side] = {"median_step_s": statistics.median(every), "mean_step_s": statistics.fmean(every),
                         "median_step_s_per_launch": [statistics.median(launch) for launch in launches],
                         "steps_timed": len(every)}
        row["ratio_ours_over_deepspeed"] = row["ours"]["median_step_s"] / row["deepspeed"]["median_step_s"]
        out["configs"][name] = row
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
