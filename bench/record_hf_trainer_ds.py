"""Record what real DeepSpeed + transformers' own Trainer logs on the issue-26 test script (the
fixture of tests/compat/test_hf_trainer.py's DeepSpeed comparison, so CI needs no DeepSpeed).

    pip install -r bench/requirements.txt    # the bench extra: DeepSpeed 0.19.8
    python bench/record_hf_trainer_ds.py [--out tests/compat/fixtures/hf_trainer_ds.json]

The script is tests/compat/hf_trainer_harness.py's: the tiny Llama from a config (seed 0), its
prompt/response rows and collator, the tutorial's TrainingArguments fields, and ``deepspeed=`` the
tutorial-shaped ds_config with every argument-decided value "auto" -- here handed to
``transformers.TrainingArguments`` / ``transformers.Trainer``, so accelerate's DeepSpeed plugin
runs ``deepspeed.initialize``.  World 2 (torchelastic via deepshard.launch.local), DeepSpeed's CPU
accelerator (DS_ACCELERATOR=cpu), gloo.  Runs: ZeRO-2 and ZeRO-3 with ``offload_optimizer`` cpu,
micro-batch 2 x accumulation 2 per rank.  DeepSpeed has no fp16 on CPU, so ZeRO-2 is recorded
with ``fp16=False`` (the ds_config's ``"fp16": {"enabled": "auto"}`` resolves to off): fp32.
accelerate needs one nudge on a CPU host (``accelerate_gloo_on_cpu``).  DeepSpeed builds its CPU ops
(FusedAdam for ZeRO-2, DeepSpeedCPUAdam for the offload) with ninja/g++ on first use.

Recorded per run: transformers' ``log_history`` (loss, grad_norm, learning_rate, step; every rank
logs the same), the ds_config after transformers filled its "auto" values, DeepSpeed's optimizer
classes and the versions.  transformers logs DeepSpeed's learning rate one update ahead of the rate
the update ran at (the engine steps the scheduler inside the update).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.* and tests.* by package path

# name -> (zero stage, offload_optimizer cpu); micro-batch 2 x accumulation 2 on each of 2 ranks
RUNS = {"zero2": (2, False), "zero3_offload": (3, True)}
MICRO, ACCUM, WORLD = 2, 2, 2


def accelerate_gloo_on_cpu() -> None:
    """accelerate 1.x picks no backend for a DeepSpeed process state on a host without an accelerator
    (``_prepare_backend`` knows DeepSpeed only with nccl/hccl/...; ``use_cpu=True`` turns DeepSpeed
    off): its PartialState then reports one process while DeepSpeed's engine runs at world 2, and
    the ds_config's train_batch_size comes out wrong.  Under a launcher (LOCAL_RANK set) without
    CUDA, hand it gloo and MULTI_CPU, which then becomes DEEPSPEED as on GPUs.  Only this recorder
    and bench/bench_hf_trainer.py do this; nothing in deepshard needs it."""
    import torch
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):  # noqa: ANN001, ANN202
        chosen, kind = original(self, cpu, sagemaker_dp, backend)
        if chosen is None and not cpu and not torch.cuda.is_available() and int(os.environ.get("LOCAL_RANK", -1)) >= 0:
            return "gloo", DistributedType.MULTI_CPU
        return chosen, kind

    PartialState._prepare_backend = prepare_backend


def plain_json(value: object) -> object:
    """The filled ds_config as strict JSON (accelerate sets steps_per_print to inf)."""
    if isinstance(value, dict):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def worker(stage: int, offload: bool, out_dir: str) -> dict:
    sys.stdout.flush()
    os.dup2(2, 1)  # DeepSpeed's banners go to stderr
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    accelerate_gloo_on_cpu()
    import deepspeed
    import torch
    import transformers

    from tests.compat.hf_trainer_harness import arguments, collate, ds_config, logged, rows, tiny_llama

    config = ds_config(stage, offload=offload)
    args = arguments(transformers.TrainingArguments, Path(out_dir), micro=MICRO, accum=ACCUM,
                     deepspeed=config, fp16=False)
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=rows(), data_collator=collate)
    assert trainer.is_deepspeed_enabled, "transformers did not take the DeepSpeed path"
    assert args.world_size == WORLD and config["train_batch_size"] == "auto"
    trainer.train()
    engine = trainer.model_wrapped
    assert isinstance(engine, deepspeed.DeepSpeedEngine), type(engine)
    return {"logs": logged(trainer), "zero_stage": engine.zero_optimization_stage(),
            "optimizer": type(engine.optimizer).__name__,
            "basic_optimizer": type(getattr(engine, "basic_optimizer", None)).__name__,
            "filled_config": plain_json(trainer.accelerator.state.deepspeed_plugin.deepspeed_config),
            "world_size": torch.distributed.get_world_size(),
            "versions": {"deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
                         "torch": torch.__version__, "accelerate": __import__("accelerate").__version__}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "tests" / "compat" / "fixtures" / "hf_trainer_ds.json"))
    ap.add_argument("--runs", nargs="+", default=list(RUNS))
    opts = ap.parse_args()
    from deepshard.launch.local import launch_local

    record: dict = {"script": "tests/compat/hf_trainer_harness.py (tiny_llama, rows, collate, ds_config, arguments)",
                    "world_size": WORLD, "micro_batch": MICRO, "gradient_accumulation_steps": ACCUM,
                    "precision": "fp32 (DeepSpeed has no fp16 on CPU: fp16=False, the ds_config's fp16 'auto')",
                    "accelerator": "DeepSpeed CPU accelerator (DS_ACCELERATOR=cpu), gloo", "runs": {}}
    for name in opts.runs:
        stage, offload = RUNS[name]
        with tempfile.TemporaryDirectory() as tmp:
            results = launch_local(worker, WORLD, stage, offload, tmp)
        first = results[0]
        assert all(r["logs"] == first["logs"] for r in results), "ranks logged different numbers"
        record["versions"] = first["versions"]
        record["runs"][name] = {"zero_stage": first["zero_stage"], "offload_optimizer": "cpu" if offload else None,
                                "optimizer": first["optimizer"], "basic_optimizer": first["basic_optimizer"],
                                "filled_config": first["filled_config"], "logs": first["logs"]}
        print(f"{name}: losses {[h['loss'] for h in first['logs']]}", file=sys.stderr)
    Path(opts.out).write_text(json.dumps(record, indent=1, allow_nan=False) + "\n")


if __name__ == "__main__":
    main()
