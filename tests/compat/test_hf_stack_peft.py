"""Issue 41's last slices, the checks without a launch: ``deepshard --accelerate_config`` (accelerate's mapping of
the yaml, bad keys and flags stop the launcher before a worker starts, one line naming the file and the key) and
LoRA adapters made under ``zero.Init`` (the session's gloo pool).  The world-2 runs of ``SFTTrainer`` with
``peft_config`` (ZeRO-2 and ZeRO-3) and of ``deepshard --accelerate_config zero3.yaml sft.py --lora`` are in
test_hf_stack.py's launches, one per layout.
"""

from __future__ import annotations

import pytest
import yaml

from tests.compat.hf_stack_layouts import zero3_yaml


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
