"""Record the LR that real DeepSpeed's engine gives each update, for WarmupLR, WarmupDecayLR and
WarmupCosineLR (the fixture of tests/core/test_lr_schedule_vs_deepspeed.py, so CI needs no DeepSpeed).

Needs the bench extra (``pip install -r bench/requirements.txt``); run from the repo root:
``python bench/record_ds_lr_schedules.py tests/core/fixtures/ds_lr_schedules.json``.
Each case builds ``deepspeed.initialize`` (world 1, CPU, gloo) on a tiny Linear with the case's
``scheduler`` and AdamW lr, and records ``engine.get_lr()[0]`` right before each ``engine.step()``:
the rate that update runs at (DeepSpeed steps its scheduler after the update).  One case also saves
a checkpoint mid-warm-up, loads it into a fresh engine and records the rates after the resume.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

BASE_LR = 1e-2
CASES = [
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2, "warmup_num_steps": 6, "warmup_type": "log"}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 1, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3, "warmup_type": "linear",
                       "total_num_steps": 12}),
    ("WarmupDecayLR", {"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2, "warmup_num_steps": 4, "warmup_type": "log",
                       "total_num_steps": 10}),
    ("WarmupCosineLR", {"warmup_min_ratio": 0.1, "warmup_num_steps": 4, "cos_min_ratio": 0.05,
                        "warmup_type": "linear", "total_num_steps": 15}),
    ("WarmupCosineLR", {"warmup_min_ratio": 0.0, "warmup_num_steps": 3, "cos_min_ratio": 1e-4, "warmup_type": "log",
                        "total_num_steps": 10}),
    ("WarmupCosineLR", {"warmup_min_ratio": 0.0, "warmup_num_steps": 1, "cos_min_ratio": 0.0,
                        "warmup_type": "linear", "total_num_steps": 8}),
]
UPDATES = 20
RESUME = {"case": 3, "save_after": 2, "updates_after": 10}  # save mid-warm-up of the first WarmupDecayLR


def _engine(name: str, params: dict):
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": BASE_LR, "weight_decay": 0.0}},
              "scheduler": {"type": name, "params": params}, "zero_optimization": {"stage": 1}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def _rates(engine, n: int) -> list[float]:
    out = []
    x = torch.ones(1, 4)
    for _ in range(n):
        out.append(float(engine.get_lr()[0]))  # the rate this update runs at
        loss = engine(x).sum()
        engine.backward(loss)
        engine.step()
    return out


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29643"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0", DS_ACCELERATOR="cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    cases = []
    for name, params in CASES:
        cases.append({"name": name, "params": params, "base_lr": BASE_LR, "lrs": _rates(_engine(name, params),
                                                                                          UPDATES)})
    name, params = CASES[RESUME["case"]]
    first = _engine(name, params)
    before = _rates(first, RESUME["save_after"])
    with tempfile.TemporaryDirectory() as tmp:
        first.save_checkpoint(tmp, tag="resume")
        fresh = _engine(name, params)
        fresh.load_checkpoint(tmp, tag="resume")
        loaded = dict(fresh.lr_scheduler.state_dict())
        after = _rates(fresh, RESUME["updates_after"])
    resume = {**RESUME, "lrs_before": before, "lrs_after": after, "scheduler_state_loaded": loaded}
    with open(sys.argv[1], "w") as f:
        json.dump({"deepspeed": deepspeed.__version__, "cases": cases, "resume": resume}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
