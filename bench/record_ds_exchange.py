"""Real DeepSpeed checkpoints of ordinary scripts (issue 34), for tests/compat/test_ds_exchange.py.

    pip install -r bench/requirements.txt    # DeepSpeed 0.19.x
    python bench/record_ds_exchange.py [--out tests/compat/fixtures] [--only tied3]

``ds_tied_zero2/`` (and ``ds_tied_zero3/``, the same at DeepSpeed's ZeRO-3) holds ``checkpoint/`` (ZeRO-2, world 2, fp32, the tiny HF Llama of
tests/compat/ds_fixture_model.py with ``tie_word_embeddings=True``, saved after 3 steps with
``client_state=CLIENT_STATE``) and ``continuation.json`` (DeepSpeed's losses for steps 4-6 after
``load_checkpoint`` in a fresh engine, and the client_state that call returned, its JSON values).
``ds_bf16_onegroup_zero2/checkpoint``: ZeRO-2, world 2, bf16, ``model_parameters=model.parameters()``
(one parameter group), saved after 3 steps: DeepSpeed's ``bf16_zero_pp_rank_*`` files.
``ds_aligned_zero2/checkpoint``: bf16 ZeRO-2 of tests/compat/ds_zero3_patterns_harness.py's TinyLM (odd
parameter sizes), two parameter groups, ``zero_optimization.parameter_alignment`` (each parameter but a
group's last padded to 16 bytes), saved after 3 steps.
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

STAGE = 2
CLIENT_STATE = {"step": SAVE_STEP, "epoch": 0, "best_loss": 3.5, "note": "tied"}


def worker(out_dir: str, stage: int = STAGE) -> dict:
    sys.stdout.flush()
    os.dup2(2, 1)  # DeepSpeed's banners go to stderr
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny_model(tied=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=ds_config(stage))
    before = train_steps(engine, range(SAVE_STEP), rank, world)
    ckpt = Path(out_dir) / "checkpoint"
    engine.save_checkpoint(str(ckpt), tag=f"global_step{SAVE_STEP}", client_state=dict(CLIENT_STATE))
    torch.distributed.barrier()
    fresh_model = tiny_model(seed=1, tied=True)
    fresh, *_ = deepspeed.initialize(model=fresh_model, model_parameters=param_groups(fresh_model),
                                     config=ds_config(stage))
    path, client_state = fresh.load_checkpoint(str(ckpt))
    assert path is not None
    after = train_steps(fresh, range(SAVE_STEP, TOTAL_STEPS), rank, world)
    returned = {k: client_state[k] for k in CLIENT_STATE}
    return {"before": before, "after": after, "client_state": returned, "version": deepspeed.__version__}


def bf16_worker(out_dir: str, aligned: bool = False) -> dict:
    sys.stdout.flush()
    os.dup2(2, 1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    if aligned:
        import torch.nn.functional as F  # noqa: N812

        from tests.compat.ds_zero3_patterns_harness import TinyLM, batch

        torch.manual_seed(0)
        model = TinyLM()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=bf16_config(True))
        before = []
        for step in range(SAVE_STEP):
            inputs, labels = batch(step, rank)
            loss = F.cross_entropy(engine(inputs).flatten(0, 1).float(), labels.flatten())
            engine.backward(loss)
            engine.step()
            before.append(loss.item())
    else:
        model = tiny_model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=bf16_config(False))
        before = train_steps(engine, range(SAVE_STEP), rank, world)
    engine.save_checkpoint(str(Path(out_dir) / "checkpoint"), tag=f"global_step{SAVE_STEP}")
    torch.distributed.barrier()
    return {"before": before, "version": deepspeed.__version__}


def bf16_config(aligned: bool) -> dict:
    config = {**ds_config(STAGE), "bf16": {"enabled": True}}
    if aligned:
        config["zero_optimization"] = {**config["zero_optimization"], "parameter_alignment": True}
    return config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "tests" / "compat" / "fixtures"))
    ap.add_argument("--only", choices=["tied3"], default=None,
                    help="record only ds_tied_zero3 (the tied model at DeepSpeed's ZeRO-3)")
    args = ap.parse_args()
    from deepshard.launch.local import launch_local

    for stage in (3,) if args.only == "tied3" else (STAGE, 3):
        out = Path(args.out) / f"ds_tied_zero{stage}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        r = launch_local(worker, 2, str(out), stage)[0]
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed copies its recovery script in
            (out / "checkpoint" / script).unlink(missing_ok=True)
        record = {"deepspeed": r["version"], "world_size": 2, "zero_stage": stage, "config": ds_config(stage),
                  "tie_word_embeddings": True, "save_step": SAVE_STEP, "client_state": r["client_state"],
                  "losses_before": r["before"], "losses_after_resume": r["after"]}
        (out / "continuation.json").write_text(json.dumps(record, indent=1) + "\n")
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"{out}: {size / 1e3:.0f} KB, DeepSpeed's losses after resume {r['after']}")
    if args.only:
        return

    for name, aligned in ((f"ds_bf16_onegroup_zero{STAGE}", False), (f"ds_aligned_zero{STAGE}", True)):
        out = Path(args.out) / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        r = launch_local(bf16_worker, 2, str(out), aligned)[0]
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (out / "checkpoint" / script).unlink(missing_ok=True)
        record = {"deepspeed": r["version"], "world_size": 2, "zero_stage": STAGE, "bf16": True,
                  "param_groups": 2 if aligned else 1, "config": bf16_config(aligned), "losses_before": r["before"]}
        (out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{out}: {sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 1e3:.0f} KB")


if __name__ == "__main__":
    main()
