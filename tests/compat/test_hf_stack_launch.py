"""Issue 41, next slice: ``accelerate launch`` with accelerate's own DeepSpeed yamls on deepshard's engine
through the provided ``deepspeed`` (TRL's ``DPOTrainer`` runs in test_hf_stack.py's launches, one per layout).

- ``DEEPSHARD_DEEPSPEED=1 accelerate launch --config_file cfg.yaml loop.py`` (a plain accelerate loop, world 2,
  fp32) at ZeRO-2 (a ``deepspeed_config_file``) and ZeRO-3 + CPU optimizer offload (the yaml's own keys,
  ``zero3_init_flag``): per-micro-batch losses against accelerate's own non-DeepSpeed multi-process path
  (MULTI_CPU, DDP over gloo) recorded by bench/record_hf_stack_ds.py (on CPU, accelerate with DeepSpeed and
  ``use_cpu`` runs one world per process, so real DeepSpeed has no world-2 run to record there);
- ``deepspeed.initialize`` without an optimizer (TRL's reference model) on the session's gloo pool;
- the accelerate yaml keys nothing would honour stop ``accelerate launch`` before a worker starts, one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deepshard.compat.accelerate_config import check
from tests.compat.hf_stack_harness import make_id_model_dir, run_launcher, write_accelerate_config

HERE = Path(__file__).parent
DS_STACK = HERE / "fixtures" / "hf_stack_ds.json"
BIN = Path(sys.executable).parent


def _env(provider: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPSHARD_DEEPSPEED", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "DEEPSHARD_DEEPSPEED": "1"} if provider else env


def _recorded(name: str) -> dict:
    fixture = json.loads(DS_STACK.read_text())
    assert fixture["versions"]["deepspeed"] == "0.19.8" and fixture["versions"]["trl"] == "1.16.0"
    return fixture["runs"][name]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_launch_deepspeed_yaml_matches_accelerate_multi_cpu(tmp_path, stage):
    cfg = write_accelerate_config(tmp_path, stage)
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", cfg, "--main_process_port", "0",
           str(HERE / "hf_stack_accelerate_script.py"), "--model", make_id_model_dir(tmp_path / "model"),
           "--result", str(tmp_path / "result.json")]
    done = run_launcher(cmd, tmp_path, _env(provider=True))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    out = json.loads((tmp_path / "result.json").read_text())
    assert out["distributed_type"] == "DEEPSPEED" and out["num_processes"] == 2 and out["zero_stage"] == stage
    assert out["engine"] == "deepshard.compat.deepspeed.engine.DeepSpeedEngine"
    assert out["gradient_accumulation_steps"] == 2
    assert done.stderr.count("deepspeed: deepshard 0.19.8+deepshard engine") == 1
    reference = _recorded("accelerate_multi_cpu")
    assert reference["distributed_type"] == "MULTI_CPU" and reference["gradient_accumulation_steps"] == 2
    assert len(out["losses"]) == len(reference["losses"]) == 8
    gap = max(abs(a - b) for a, b in zip(out["losses"], reference["losses"], strict=True))
    assert gap < 1e-5, f"ZeRO-{stage}: losses differ from accelerate's MULTI_CPU run by {gap}"
    assert out["losses"][-1] < out["losses"][0]


# --- the accelerate yaml's keys: refused before anything starts, one line naming the file and the key

def _yaml(tmp_path: Path, **change: object) -> Path:
    cfg = yaml.safe_load(Path(write_accelerate_config(tmp_path, 3)).read_text())
    for key, value in change.items():
        section, _, sub = key.partition("__")
        if sub:
            cfg.setdefault(section, {})[sub] = value
        else:
            cfg[key] = value
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(("change", "named"), [
    ({"use_cpu": True}, "use_cpu=True"),
    ({"mixed_precision": "fp8"}, "mixed_precision=fp8"),
    ({"parallelism_config__parallelism_config_sp_size": 2}, "parallelism_config.parallelism_config_sp_size=2"),
    ({"deepspeed_config__deepspeed_moe_layer_cls_names": "MixtralSparseMoeBlock"},
     "deepspeed_config.deepspeed_moe_layer_cls_names=MixtralSparseMoeBlock"),
    ({"deepspeed_config__zero_stage": 4}, "deepspeed_config.zero_stage=4"),
    ({"deepspeed_config__offload_optimizer_device": "disk"}, "deepspeed_config.offload_optimizer_device=disk"),
    ({"deepspeed_config__zero_stage3_typo": 1}, "deepspeed_config.zero_stage3_typo=1"),
    ({"num_machines": 2, "deepspeed_config__deepspeed_multinode_launcher": "pdsh"},
     "deepspeed_config.deepspeed_multinode_launcher=pdsh"),
])
def test_accelerate_yaml_keys_refused(tmp_path, change, named):
    path = _yaml(tmp_path, **change)
    with pytest.raises(ValueError) as err:
        check(path)
    assert str(err.value).startswith(f"{path}: {named}: ") and "\n" not in str(err.value)


def test_accelerate_ds_config_file_keys_refused(tmp_path):
    ds = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "Lamb", "params": {"lr": "auto"}},
          "train_micro_batch_size_per_gpu": "auto"}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    path = _yaml(tmp_path, deepspeed_config={"deepspeed_config_file": str(tmp_path / "ds.json")})
    with pytest.raises(ValueError, match=r"ds\.json: optimizer\.type=Lamb: not supported"):
        check(path)
    ds["sequence_parallel_size"] = 2
    del ds["optimizer"]
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    with pytest.raises(ValueError, match=r"ds\.json: sequence_parallel_size=2: not supported"):
        check(path)


def test_stock_accelerate_yamls_load(tmp_path):
    """TRL's examples/accelerate_configs/deepspeed_zero{1,2,3}.yaml (their keys, as TRL 1.16 ships them) pass."""
    for stage in (1, 2, 3):
        path = _yaml(tmp_path, mixed_precision="bf16", num_processes=8,
                     deepspeed_config={"deepspeed_multinode_launcher": "standard", "offload_optimizer_device": "none",
                                       "offload_param_device": "none", "zero3_init_flag": stage == 3,
                                       "zero3_save_16bit_model": stage == 3, "zero_stage": stage})
        check(path)
    check(_yaml(tmp_path, distributed_type="MULTI_GPU", use_cpu=True))  # not DeepSpeed: not ours to judge


def test_accelerate_launch_stops_before_start(tmp_path):
    """Through accelerate's own command: rc 2 and one line, no worker started (the script would write a file)."""
    path = _yaml(tmp_path, use_cpu=True)
    script = tmp_path / "train.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    done = subprocess.run([str(BIN / "accelerate"), "launch", "--config_file", str(path), str(script)], cwd=tmp_path,
                          env=_env(provider=True), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: {path}: use_cpu=True: accelerate then starts each process as its own world without DeepSpeed; "
        f"set use_cpu: false (on a host without GPUs deepshard's engine runs on the CPU)")
    assert not (tmp_path / "started").exists()


def test_initialize_without_optimizer_is_forward_only():
    """TRL's reference model: stage 0 a replica, stage 3 sharded (built under zero.Init, loaded in
    GatheredParameters); the plain model's logits either way, no optimizer, training refused in one line."""
    from tests.compat.hf_stack_harness import forward_only_engines
    from tests.gloo_pool import pool

    for rank, out in enumerate(pool(2).run(forward_only_engines)):
        for stage, sharded in (("stage0", False), ("stage3", True)):
            got = out[stage]
            assert got["type"] == "InferenceEngine" and got["rest"] == [None, None, None], (rank, stage)
            assert got["sharded"] is sharded, (rank, stage)
            assert got["gap"] < 1e-6, f"rank {rank} {stage}: logits differ from the plain model's by {got['gap']}"
            assert got["refused"].startswith("engine.backward(): this engine was initialized without an optimizer")
