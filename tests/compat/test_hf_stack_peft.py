"""Issue 41's last slices: TRL's ``SFTTrainer`` with ``peft_config`` (LoRA) at ZeRO-3 through the provided
``deepspeed``, and ``deepshard --accelerate_config``.

- ``deepshard --num_gpus 2 sft.py --lora --save`` (ZeRO-3 + CPU optimizer offload, the model by path under
  ``zero.Init``, fp32): losses against real DeepSpeed 0.19.8's recorded run of the same script
  (fixtures/hf_stack_ds.json, bench/record_hf_stack_ds.py); checkpoint-2 (saved with
  ``exclude_frozen_parameters``, as transformers asks for PEFT models) resumed by a fresh trainer gives the
  uninterrupted steps 3-4; the saved adapter loads with ``peft.PeftModel`` on the base model with the
  engine's logits;
- ``deepshard --accelerate_config zero3.yaml sft.py --lora`` (TRL's ``deepspeed_zero3.yaml`` shape, no
  ``deepspeed=`` in the script: accelerate's environment carries it) gives the losses of the run above, whose
  ds_config says the same;
- a yaml key nothing would honour stops ``deepshard`` before a worker starts, one line naming file and key.

Two launches (~20-40 s each here), shared by the tests of this module.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from tests.compat.hf_stack_harness import make_model_dir, run_launcher, write_ds_config

HERE = Path(__file__).parent
DS_STACK = HERE / "fixtures" / "hf_stack_ds.json"  # real DeepSpeed + TRL + PEFT (bench/record_hf_stack_ds.py)
BIN = Path(sys.executable).parent
SCRIPT = HERE / "hf_stack_sft_script.py"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("DEEPSHARD_DEEPSPEED", "RANK", "WORLD_SIZE", "LOCAL_RANK")
            and not k.startswith("ACCELERATE_")}


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


def _launch(flags: list[str], tmp: Path, *script_args: str) -> dict:
    argv = [str(BIN / "deepshard"), *flags, str(SCRIPT), "--model", str(tmp.parent / "model"), "--lora",
            "--out", str(tmp / "out"), "--result", str(tmp / "result.json"), *script_args]
    done = run_launcher(argv, tmp, _env())
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return {**json.loads((tmp / "result.json").read_text()), "stderr": done.stderr}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The ds_config run (with checkpoints, save, resume) and the accelerate-yaml run, on one model dir."""
    root = tmp_path_factory.mktemp("peft")
    make_model_dir(root / "model")
    (root / "ds").mkdir()
    (root / "yaml").mkdir()
    ds = _launch(["--num_gpus", "2"], root / "ds", "--ds_config",
                 write_ds_config(root / "ds" / "ds.json", 3, optimizer=False), "--save")
    acc = _launch(["--accelerate_config", str(zero3_yaml(root / "yaml"))], root / "yaml")
    return {"ds": ds, "yaml": acc, "root": root}


def _recorded() -> dict:
    fixture = json.loads(DS_STACK.read_text())
    assert fixture["versions"]["deepspeed"] == "0.19.8" and fixture["versions"]["trl"] == "1.16.0"
    return fixture["runs"]["sft_lora_zero3_offload"]


@pytest.mark.slow
def test_sft_lora_zero3_matches_deepspeed_resumes_and_saves_the_adapter(runs):
    out, theirs = runs["ds"], _recorded()
    assert out["engine"] == "deepshard.compat.deepspeed.engine" and out["world_size"] == 2
    assert theirs["peft"] == "PeftModelForCausalLM" and out["peft"].endswith(theirs["peft"])  # FSDP2 names it FSDP...
    assert out["trainable"] == theirs["trainable"]
    assert [h["step"] for h in out["logs"]] == [h["step"] for h in theirs["logs"]] == [1.0, 2.0, 3.0, 4.0]
    gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(out["logs"], theirs["logs"], strict=True))
    assert gap < 1e-5, f"LoRA at ZeRO-3: losses differ from DeepSpeed's by {gap}"
    assert [h["grad_norm"] for h in out["logs"]] == pytest.approx([h["grad_norm"] for h in theirs["logs"]], rel=2e-4)
    assert out["logs"][-1]["loss"] < out["logs"][0]["loss"]
    # checkpoint-2, saved without the frozen base (exclude_frozen_parameters), resumed by a fresh trainer
    resumed = [h for h in out["resumed"] if h["step"] > 2]
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in out["logs"][2:]], abs=1e-6)
    assert [h["loss"] for h in resumed] == pytest.approx([h["loss"] for h in theirs["resumed"] if h["step"] > 2],
                                                          abs=1e-5)
    manifest = next(f for f in out["checkpoint_files"] if f.endswith("manifest.json"))
    meta = json.loads((runs["root"] / "ds" / "out" / "checkpoint-2" / manifest).read_text())["meta"]
    assert meta == {"exclude_frozen_parameters": True}
    # the adapter, as DeepSpeed's run saved it, loads with PEFT on the base model and gives the engine's logits
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(out["final_files"])
    assert "model.safetensors" not in out["final_files"] and set(theirs["final_files"]) == set(out["final_files"])
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.compat.hf_stack_sft_script import probe

    model_dir = str(runs["root"] / "model")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                       str(runs["root"] / "ds" / "out" / "final")).eval()
    with torch.no_grad():
        gap = (loaded(**probe(model_dir)).logits - torch.tensor(out["logits"])).abs().max().item()
    assert gap < 1e-5, f"the saved adapter's logits differ from the engine's by {gap}"


@pytest.mark.slow
def test_accelerate_config_equals_the_ds_config_run(runs):
    ds, acc = runs["ds"], runs["yaml"]
    assert acc["engine"] == "deepshard.compat.deepspeed.engine" and acc["world_size"] == 2
    assert acc["stderr"].count("deepspeed: deepshard 0.19.8+deepshard engine") == 1
    assert [h["step"] for h in acc["logs"]] == [1.0, 2.0, 3.0, 4.0]
    for mine, theirs in zip(acc["logs"], ds["logs"], strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-6)
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        assert mine["learning_rate"] == pytest.approx(theirs["learning_rate"], abs=1e-12)


def test_accelerate_config_maps_like_accelerate_launch(tmp_path):
    """The workers' variables are accelerate's own mapping of the yaml (no launch)."""
    from deepshard.compat.accelerate_config import launch_env

    num, env = launch_env(zero3_yaml(tmp_path))
    assert num == 2
    assert {k: env[k] for k in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_ZERO_STAGE",
                                "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                                "ACCELERATE_DEEPSPEED_ZERO3_INIT", "ACCELERATE_MIXED_PRECISION")} == {
        "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "2",
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true", "ACCELERATE_MIXED_PRECISION": "no"}


@pytest.mark.parametrize(("change", "named"), [
    ({"sequence_parallel_size": 2}, "deepspeed_config.sequence_parallel_size=2"),
    ({"zero_stage": 5}, "deepspeed_config.zero_stage=5"),
    ({"offload_param_device": "disk"}, "deepspeed_config.offload_param_device=disk"),
])
def test_accelerate_config_bad_key_stops_the_launcher(tmp_path, capsys, change, named):
    """``deepshard --accelerate_config``: rc 2, one line naming the file and the key, no worker started."""
    from deepshard.launch.cli import run

    path = zero3_yaml(tmp_path, **change)
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    assert run(["--accelerate_config", str(path), str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: {named}: "), err
    assert not (tmp_path / "started").exists()


@pytest.mark.parametrize(("top", "flags", "named"), [
    ({"distributed_type": "MULTI_GPU"}, [], "{path}: distributed_type=MULTI_GPU: "),
    ({"num_machines": 2}, [], "{path}: num_machines=2: "),
    ({}, ["--num_gpus", "4"], "--num_gpus=4 and {path}'s num_processes=2 differ"),
    ({}, ["--hostfile", "hosts"], "--accelerate_config={path}: starts one node"),
])
def test_accelerate_config_bad_top_level_key_or_flag_stops_the_launcher(tmp_path, capsys, top, flags, named):
    """The yaml's own keys and the launcher's flags beside it: rc 2, one line naming them, no worker started."""
    from deepshard.launch.cli import run

    path = zero3_yaml(tmp_path)
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **top}))
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    assert run([*flags, "--accelerate_config", str(path), str(script)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and named.format(path=path) in err[0], err
    assert not (tmp_path / "started").exists()


def test_lora_adapters_survive_zero_init():
    """PEFT moves new adapters onto the base layer's device, the meta device under our zero.Init: the provider's
    patch keeps them real, and initialize shards rank 0's values (without it B was re-drawn, not zero)."""
    from tests.compat.hf_stack_harness import lora_under_zero_init
    from tests.gloo_pool import pool

    out = pool(2).run(lora_under_zero_init)
    for rank, got in enumerate(out):
        assert got["real"] and got["b_zero"], (rank, got["real"], got["b_zero"])
        assert got["gap"] < 1e-6, f"rank {rank}: LoRA at init changed the logits by {got['gap']}"
        assert got["a"] == out[0]["drawn"], f"rank {rank}: A is not rank 0's drawn value"
    assert out[1]["drawn"] != out[0]["drawn"]
