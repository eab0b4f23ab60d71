"""Issue 41's world-2 runs of the HF-stack scripts, one launch per layout (tests/compat/test_hf_stack.py):
each launch's workers run the layout's scripts one after another (tests/compat/hf_stack_runner.py), each as
in a fresh worker, so a script's logs are those of its own launch, at a launch's cost (10-20 s here) per
layout instead of per script.

- ``zero2``: ``deepshard --num_gpus 2``, the ZeRO-2 ds_configs: the plain Trainer (a ds_config with an
  optimizer section) and ``SFTTrainer`` full (both ``evaluate()`` before and after training), ``SFTTrainer`` with
  LoRA, ``DPOTrainer`` (each saving checkpoint-2/-4 and the model, then resuming checkpoint-2 in a fresh
  trainer), ``GRPOTrainer`` (checkpoint-3 resumed);
- ``zero3_offload``: ``deepshard --accelerate_config deepspeed_zero3.yaml`` (TRL's yaml shape): first the LoRA
  ``SFTTrainer`` with no ``deepspeed=`` (accelerate's variables carry the layout), then, without accelerate's
  variables (what ``deepshard --num_gpus 2`` gives its workers), the ZeRO-3 + CPU optimizer offload
  ds_configs: the same five (saving and resuming; the plain Trainer and the full ``SFTTrainer`` evaluate before and
  after training)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.compat.hf_stack_harness import make_model_dir, run_launcher, write_ds_config

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
SFT, DPO, GRPO = (HERE / f"hf_stack_{name}_script.py" for name in ("sft", "dpo", "grpo"))
TRAINER = HERE / "hf_stack_trainer_script.py"


def zero3_yaml(folder: Path, **deepspeed_config: object) -> Path:
    """TRL's examples/accelerate_configs/deepspeed_zero3.yaml for 2 processes, fp32, the optimizer on the CPU
    and 2 accumulation steps: the ds_config of write_ds_config(stage=3, optimizer=False) in accelerate's words."""
    cfg = {"compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": "DEEPSPEED",
           "downcast_bf16": "no", "machine_rank": 0, "main_training_function": "main", "mixed_precision": "no",
           "num_machines": 1, "num_processes": 2, "rdzv_backend": "static", "same_network": True, "tpu_env": [],
           "tpu_use_cluster": False, "tpu_use_sudo": False, "use_cpu": False,
           "deepspeed_config": {"deepspeed_multinode_launcher": "standard", "gradient_accumulation_steps": 2,
                                "offload_optimizer_device": "cpu", "offload_param_device": "none",
                                "zero3_init_flag": True, "zero3_save_16bit_model": True, "zero_stage": 3,
                                **deepspeed_config}}
    path = folder / "deepspeed_zero3.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _plan(layout: str, root: Path, model: str) -> dict[str, dict[str, Any]]:
    """The layout's runs in launch order: name -> the runner's entry (script, argv, accelerate)."""
    stage = 2 if layout == "zero2" else 3
    with_optimizer = write_ds_config(root / "ds_optimizer.json", stage)  # the plain Trainer's (issue 26's recording)
    stock = write_ds_config(root / "ds.json", stage, optimizer=False)  # TRL's stock shape: no optimizer section
    runs = [("trainer", TRAINER, ["--ds_config", with_optimizer, "--evaluate"]),
            ("sft", SFT, ["--model", model, "--ds_config", stock, "--save", "--evaluate", "before", "after"]),
            ("sft_lora", SFT, ["--model", model, "--ds_config", stock, "--lora", "--save"]),
            ("dpo", DPO, ["--model", model, "--ds_config", stock, "--save"]),
            ("grpo", GRPO, ["--model", model, "--ds_config", stock, "--save"])]
    if stage == 3:
        runs = [("sft_lora_yaml", SFT, ["--model", model, "--lora"]), *runs]
    plan = {}
    for short, script, argv in runs:
        name = short if short == "sft_lora_yaml" else f"{short}_{layout}"
        (root / name).mkdir()
        plan[name] = {"script": str(script), "accelerate": short == "sft_lora_yaml",
                      "argv": [*argv, "--out", str(root / name / "out"), "--result", str(root / name / "result.json")]}
    return plan


def launch(layout: str, root: Path) -> dict[str, Any]:
    """One world-2 launch of the layout's scripts: ``{"stderr": ..., "runs": {name: result + tmp, model}}``."""
    model = make_model_dir(root / "model")
    plan = _plan(layout, root, model)
    (root / "plan.json").write_text(json.dumps(list(plan.values())))
    start = ["--num_gpus", "2"] if layout == "zero2" else ["--accelerate_config", str(zero3_yaml(root))]
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPSHARD_DEEPSPEED", "RANK", "WORLD_SIZE", "LOCAL_RANK")
           and not k.startswith("ACCELERATE_")}  # the launcher sets the provider's variable (and accelerate's)
    done = run_launcher([str(BIN / "deepshard"), *start, str(HERE / "hf_stack_runner.py"), "--plan",
                         str(root / "plan.json")], root, env, timeout=900)
    assert done.returncode == 0, f"the {layout} launch: " + (done.stdout + done.stderr)[-4000:]
    return {"stderr": done.stderr, "runs": {
        name: {**json.loads((root / name / "result.json").read_text()), "tmp": str(root / name), "model": model}
        for name in plan}}


class Layouts:
    """The module's launches, each started when a test first asks for its layout (a failed one fails every
    test that asks, without starting again)."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory, self._done, self._failed = factory, {}, {}

    def __call__(self, layout: str) -> dict[str, Any]:
        if layout in self._failed:
            pytest.fail(self._failed[layout], pytrace=False)
        if layout not in self._done:
            try:
                self._done[layout] = launch(layout, self._factory.mktemp(layout))
            except Exception as err:  # a failed or hung launch, a missing result
                self._failed[layout] = f"{type(err).__name__}: {err}"
                raise
        return self._done[layout]
