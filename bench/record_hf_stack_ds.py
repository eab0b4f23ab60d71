"""Record what real DeepSpeed logs on issue 41's HF-stack scripts (the fixture of tests/compat/test_hf_stack.py,
so CI needs no DeepSpeed).

    /tmp/benchvenv/bin/pip install trl==1.16.0 -c constraints.txt   # a venv with deepspeed 0.19.8, no deepshard
    /tmp/benchvenv/bin/python bench/record_hf_stack_ds.py [--out tests/compat/fixtures/hf_stack_ds.json]

Runs, at world 2 on CPU in fp32 (DeepSpeed's CPU accelerator, gloo), each started as users start it
with ``deepspeed --num_gpus 2 <script>`` (``--launcher torchrun``: ``torchrun --nproc_per_node 2``):

- ``sft_zero3_offload``: tests/compat/hf_stack_sft_script.py (TRL 1.16 ``SFTTrainer``, chat rows, loss on
  completions only, the model by path) with ``--save`` (checkpoint-2/-4, the model saved, checkpoint-2 resumed by
  a fresh trainer) and the ZeRO-3 + CPU optimizer offload ds_config of tests/compat/hf_stack_harness.py without an
  optimizer section (as TRL's stock configs: Trainer's AdamW);
- ``sft_zero2``: the same script (full fine-tune, ``--save``) with the ZeRO-2 ds_config (no optimizer section);
- ``sft_lora_zero3_offload``, ``sft_lora_zero2``: the same script with ``--lora --save`` (``peft_config=LoraConfig(...)``,
  PEFT 0.21; checkpoint-2/-4 with ``exclude_frozen_parameters``, the adapter saved, checkpoint-2 resumed by a fresh
  trainer) at ZeRO-3 + CPU optimizer offload and at ZeRO-2;
- ``sft_trl_alone``: no DeepSpeed, TRL's own ``SFTTrainer`` in one process on the same model and rows with micro 4 x
  accumulation 2 (``use_cpu``): each step sees the rows of a world-2 step (rank r takes micro-batches r, r+2, ...)
  and the loss is token-weighted, so the world-2 runs' losses equal it;
- ``dpo_zero2``, ``dpo_zero3_offload``: tests/compat/hf_stack_dpo_script.py (TRL 1.16 ``DPOTrainer``, preference
  rows, the reference model TRL loads itself and prepares with ``deepspeed.initialize`` without an optimizer)
  with the same ds_configs at ZeRO-2 and at ZeRO-3 + CPU optimizer offload, ``--save`` (checkpoint-2/-4, the
  model saved, checkpoint-2 resumed by a fresh trainer);
- ``grpo_zero3_offload``, ``grpo_zero2``: tests/compat/hf_stack_grpo_script.py (TRL 1.16 ``GRPOTrainer``,
  ``use_vllm=False``: generation with the policy in TRL's ``unwrap_model_for_generation``, under ZeRO-3 gathered,
  sampling seeded per step) with the ZeRO-3 + CPU optimizer offload and the ZeRO-2 ds_configs, ``--save``
  (checkpoint-3, the model saved, checkpoint-3 resumed by a fresh trainer); its time per step inside that
  generation is kept too;
- ``sft_eval_zero2``, ``sft_eval_zero3_offload``: the SFT script (full fine-tune, no saving) with ``--evaluate before
  after``: ``evaluate()`` on held-out rows, two per device, by a fresh trainer before training (at ZeRO-2
  transformers refuses it: the line is kept) and by the trainer after its 4 steps;
- ``sft_eval_no_deepspeed``: the same script with ``--no_deepspeed --evaluate before after`` under ``torchrun
  --nproc_per_node 2``: transformers' own multi-process CPU path (DDP over gloo), the reference for the evaluation
  before training (the same model, the same 2 processes, the same two rows per device);
- ``accelerate_multi_cpu``: tests/compat/hf_stack_accelerate_script.py (a plain accelerate loop) on accelerate's
  own non-DeepSpeed multi-process path, the reference for ``accelerate launch`` with accelerate's DeepSpeed
  yamls (on CPU, accelerate launches ``distributed_type: DEEPSPEED`` with ``use_cpu: true`` as one world per
  process, so DeepSpeed itself gives no world-2 run there to record).

``--runs NAME...`` re-records some runs and keeps the others in the fixture.

The one change to how the script runs: accelerate 1.16 picks no distributed backend for a DeepSpeed
process state on a host without an accelerator, so each worker first applies the nudge that
bench/record_hf_trainer_ds.py applies (gloo, MULTI_CPU; deepshard's provider applies the same one,
deepshard.compat.hf_cpu), then runs the script unchanged with ``runpy``.  The plain Trainer's runs are
issue 26's recording (bench/record_hf_trainer_ds.py, fixtures/hf_trainer_ds.json), on the same model, rows,
arguments and ds_configs that tests/compat/hf_stack_trainer_script.py uses.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"sft_zero3_offload": ("tests/compat/hf_stack_sft_script.py", 3),
        "sft_zero2": ("tests/compat/hf_stack_sft_script.py", 2),
        "sft_lora_zero3_offload": ("tests/compat/hf_stack_sft_script.py", 3),
        "sft_lora_zero2": ("tests/compat/hf_stack_sft_script.py", 2),
        "dpo_zero2": ("tests/compat/hf_stack_dpo_script.py", 2),
        "dpo_zero3_offload": ("tests/compat/hf_stack_dpo_script.py", 3),
        "grpo_zero3_offload": ("tests/compat/hf_stack_grpo_script.py", 3),
        "grpo_zero2": ("tests/compat/hf_stack_grpo_script.py", 2),
        "sft_eval_zero2": ("tests/compat/hf_stack_sft_script.py", 2),
        "sft_eval_zero3_offload": ("tests/compat/hf_stack_sft_script.py", 3),
        "sft_eval_no_deepspeed": ("tests/compat/hf_stack_sft_script.py", None)}
FLAGS = {"sft_lora_zero3_offload": ["--lora", "--save"], "sft_lora_zero2": ["--lora", "--save"], "sft_zero2": ["--save"],
         "sft_zero3_offload": ["--save"], "dpo_zero2": ["--save"], "dpo_zero3_offload": ["--save"],
         "grpo_zero3_offload": ["--save"], "grpo_zero2": ["--save"], "sft_eval_zero2": ["--evaluate", "before", "after"],
         "sft_eval_zero3_offload": ["--evaluate", "before", "after"],
         "sft_eval_no_deepspeed": ["--no_deepspeed", "--evaluate", "before", "after"]}  # the script's own flags, per run
KEPT = ("resumed", "trainable", "peft", "checkpoint_files", "final_files",  # recorded besides the logs, when present
        "eval_before", "eval_after")
ACCELERATE = "tests/compat/hf_stack_accelerate_script.py"  # the reference: accelerate's MULTI_CPU path, no DeepSpeed


def worker(script: str, argv: list[str]) -> None:
    """One rank: the accelerate CPU nudge, then the user's script as ``python script.py argv``."""
    sys.path.insert(0, str(ROOT))
    from bench.record_hf_trainer_ds import accelerate_gloo_on_cpu

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    accelerate_gloo_on_cpu()
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def record(name: str, launcher: str, tmp: Path) -> dict:
    script, stage = RUNS[name]
    sys.path.insert(0, str(ROOT))
    from tests.compat.hf_stack_harness import make_model_dir, write_ds_config

    config = [] if stage is None else ["--ds_config", write_ds_config(tmp / "ds.json", stage, optimizer=False)]
    argv = ["--model", make_model_dir(tmp / "model"), *config,
            "--out", str(tmp / "out"), "--result", str(tmp / "result.json"), *FLAGS.get(name, [])]
    bindir = Path(sys.executable).parent
    start = ([str(bindir / "deepspeed"), "--num_gpus", "2"] if launcher == "deepspeed" and stage is not None
             else [str(bindir / "torchrun"), "--standalone", "--nproc_per_node", "2"])
    cmd = [*start, str(Path(__file__).resolve()), "--worker", str(ROOT / script), "--", *argv]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("DEEPSHARD_DEEPSPEED", None)
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{name}: {launcher} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    result = json.loads((tmp / "result.json").read_text())
    assert stage is None or not result["deepspeed"].endswith("+deepshard"), "the recording must run real DeepSpeed"
    return result


def record_accelerate_multi_cpu(tmp: Path) -> dict:
    """The plain accelerate loop on accelerate's own non-DeepSpeed multi-process path: what ``accelerate launch``
    with ``distributed_type: MULTI_CPU`` runs (``ACCELERATE_USE_CPU=true``, DDP over gloo), started by torchrun
    (accelerate launches MULTI_CPU through mpirun, absent here), gradient accumulation 2 as the DeepSpeed yamls say."""
    sys.path.insert(0, str(ROOT))
    from tests.compat.hf_stack_harness import make_id_model_dir

    bindir = Path(sys.executable).parent
    cmd = [str(bindir / "torchrun"), "--standalone", "--nproc_per_node", "2", str(ROOT / ACCELERATE),
           "--model", make_id_model_dir(tmp / "model"), "--result", str(tmp / "result.json")]
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",
           "OMP_NUM_THREADS": "1"}
    env.pop("DEEPSHARD_DEEPSPEED", None)
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"accelerate MULTI_CPU: torchrun exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    result = json.loads((tmp / "result.json").read_text())
    assert result["distributed_type"] == "MULTI_CPU" and result["num_processes"] == 2, result
    return result


TRL_ALONE = """
import json, sys
sys.path.insert(0, {root!r})
from datasets import Dataset
from trl import SFTConfig, SFTTrainer
from tests.compat.hf_stack_harness import chat_rows
args = SFTConfig(output_dir={out!r}, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                 learning_rate=3e-3, max_steps=4, logging_steps=1, save_strategy="no", report_to=[], seed=0,
                 bf16=False, fp16=False, max_length=64, completion_only_loss=True, use_cpu=True,
                 train_sampling_strategy="sequential", disable_tqdm=True, model_init_kwargs={{"dtype": "float32"}})
t = SFTTrainer(model={model!r}, args=args, train_dataset=Dataset.from_list(chat_rows()))
t.train()
print(json.dumps([{{k: float(v) for k, v in h.items() if k in ("loss", "grad_norm", "learning_rate", "step")}}
                  for h in t.state.log_history if "loss" in h]))
"""


def record_trl_alone(tmp: Path) -> dict:
    """TRL's SFTTrainer without DeepSpeed, one process (the reference tests/compat/test_hf_stack.py's ZeRO-3
    ``SFTTrainer`` run once started beside its launch)."""
    sys.path.insert(0, str(ROOT))
    from tests.compat.hf_stack_harness import make_model_dir

    code = TRL_ALONE.format(root=str(ROOT), out=str(tmp / "out"), model=make_model_dir(tmp / "model"))
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPSHARD_DEEPSPEED", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_NUM_THREADS": "2"}, capture_output=True,
                          text=True, timeout=1200, cwd=tmp)
    if done.returncode != 0:
        raise SystemExit(f"sft_trl_alone: exited {done.returncode}:\n{done.stderr[-4000:]}")
    return {"script": "SFTTrainer without DeepSpeed (bench/record_hf_stack_ds.py's TRL_ALONE)", "world_size": 1,
            "deepspeed": None, "logs": json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "tests" / "compat" / "fixtures" / "hf_stack_ds.json"))
    ap.add_argument("--runs", nargs="+", default=[*RUNS, "accelerate_multi_cpu", "sft_trl_alone"])
    ap.add_argument("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    opts, rest = ap.parse_known_args()
    if opts.worker:
        worker(opts.worker, [a for a in rest if a != "--"])
        return
    import accelerate
    import deepspeed
    import torch
    import transformers
    import trl

    fixture: dict = {"world_size": 2, "precision": "fp32", "launcher": f"{opts.launcher} (2 workers)",
                     "accelerator": "DeepSpeed CPU accelerator (DS_ACCELERATOR=cpu), gloo",
                     "versions": {"deepspeed": deepspeed.__version__, "transformers": transformers.__version__,
                                  "accelerate": accelerate.__version__, "trl": trl.__version__,
                                  "torch": torch.__version__}, "runs": {}}
    if Path(opts.out).exists():  # recording some runs keeps the others
        fixture["runs"] = json.loads(Path(opts.out).read_text())["runs"]
    for name in opts.runs:
        with tempfile.TemporaryDirectory() as tmp:
            if name == "sft_trl_alone":
                fixture["runs"][name] = record_trl_alone(Path(tmp))
                print(f"{name}: losses {[h['loss'] for h in fixture['runs'][name]['logs']]}", file=sys.stderr)
                continue
            if name == "accelerate_multi_cpu":
                result = record_accelerate_multi_cpu(Path(tmp))
                fixture["runs"][name] = {"script": ACCELERATE, "distributed_type": result["distributed_type"],
                                         "gradient_accumulation_steps": result["gradient_accumulation_steps"],
                                         "losses": result["losses"]}
                print(f"{name}: losses {result['losses']}", file=sys.stderr)
                continue
            result = record(name, opts.launcher, Path(tmp))
        fixture["runs"][name] = {"script": RUNS[name][0], "zero_stage": RUNS[name][1], "logs": result["logs"]}
        fixture["runs"][name].update({k: result[k] for k in KEPT if k in result})
        if "generation_seconds" in result:  # GRPO: seconds per step inside TRL's unwrap_model_for_generation
            fixture["runs"][name]["generation_seconds"] = result["generation_seconds"]
        print(f"{name}: losses {[h['loss'] for h in result['logs']]}", file=sys.stderr)
    Path(opts.out).write_text(json.dumps(fixture, indent=1) + "\n")


if __name__ == "__main__":
    main()
