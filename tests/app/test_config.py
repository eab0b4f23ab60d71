"""Every config group composes and validates; bad values fail before work, naming the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from deepshard.finetune.config import register, validate
from tests.app_runner import run_main

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
register()


def _compose(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    return OmegaConf.to_container(cfg, resolve=True)


def _group_overrides() -> list[list[str]]:
    out = []
    for group in sorted(p for p in CONF.iterdir() if p.is_dir()):
        for option in sorted(group.glob("*.yaml")):
            if group.name in ("zero", "peft"):  # absent from the defaults list: added with +
                out.append([f"+{group.name}={option.stem}"])
            elif (group.name, option.stem) == ("model", "hf"):
                continue  # needs a HF checkpoint directory: tests/checkpoint/test_hf_roundtrip.py
            elif group.name == "offload":  # needs a sharding stage, and nvme a directory
                out.append([f"+offload={option.stem}", "+zero=stage3", "offload.nvme_path=/tmp"])
            else:
                out.append([f"{group.name}={option.stem}"])
    return out


def _group_target(settings, group: str):
    """Where a group's values land in the typed settings."""
    return {"zero": settings.engine.zero, "precision": settings.engine.precision, "optim": settings.engine.optim,
            "scheduler": settings.engine.scheduler, "model": settings.model, "data": settings.data,
            "offload": settings.offload, "peft": settings.peft}[group]


@pytest.mark.parametrize("overrides", _group_overrides(), ids=lambda o: o[0])
def test_every_group_option_composes_and_validates(overrides):
    composed = _compose(overrides)
    settings = validate(composed)
    group, option = overrides[0].lstrip("+").split("=")
    target = _group_target(settings, group)
    # every key the option's file sets (interpolations resolved by the composition) reaches the settings
    for key in OmegaConf.to_container(OmegaConf.load(CONF / group / f"{option}.yaml")):
        if key == "name" and not hasattr(target, "name"):
            continue  # the model's preset name lives beside its architecture
        want = composed[group][key]
        if group == "precision" and key == "dtype":
            cuda = torch.cuda.is_available()  # auto: bf16 on CUDA; fp16 on a CPU-only host falls back to fp32
            want = {"auto": "bf16" if cuda else "fp32", "fp16": "fp16" if cuda else "fp32"}.get(option, option)
        got = getattr(target, key)
        got = list(got) if isinstance(got, tuple) else got
        if dataclasses.is_dataclass(got):  # a nested config (offload.aio)
            got = dataclasses.asdict(got)
        assert got == want, (group, option, key, got, want)
    if group == "zero":
        assert settings.engine.zero.stage == int(option[-1])
    if group == "model":
        assert settings.model_name == option


def test_no_zero_group_means_stage0():
    assert validate(_compose([])).engine.zero.stage == 0


@pytest.mark.parametrize("override,key", [
    ("train.micro_batch_size=0", "train.micro_batch_size"),
    ("train.grad_accum=-1", "train.grad_accum"),
    ("+zero=stage2 zero.reduce_bucket_size=-4", "zero.reduce_bucket_size"),
    ("scheduler.name=OneCycle", "scheduler.name"),
    ("ac=sometimes", "ac"),
    ("launcher.nproc_per_node=zero", "launcher.nproc_per_node"),
    ("data.seq_len=4096", "data.seq_len"),
    ("model.n_heads=7", "model.dim"),
    ("optim.lr=-1", "optim.lr"),
    ("precision.hysteresis=0", "precision.hysteresis"),
    ("+offload=cpu", "offload.device"),
    ("+zero=stage2 +offload=cpu offload.params=cpu", "offload.params"),
    ("+zero=stage2 +offload=nvme offload.nvme_path=/no/such/dir", "offload.nvme_path"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(_compose(override.split()))


@pytest.mark.parametrize("override,message", [
    ("launcher.hang_s=nan", "launcher.hang_s=nan: must be a finite number >= 0 seconds (0: no hang watchdog)"),
    ("launcher.hang_s=inf", "launcher.hang_s=inf: must be a finite number >= 0 seconds (0: no hang watchdog)"),
    ("launcher.hang_s=-1", "launcher.hang_s=-1.0: must be >= 0 seconds (0: no hang watchdog)"),
    ("launcher.timeout_s=inf", "launcher.timeout_s=inf: must be a finite number > 0 seconds"),
])
def test_launcher_seconds_must_be_finite(override, message):
    """Issue 45 item 10: ``launcher.hang_s=nan`` passed the ``< 0`` check and turned the watchdog off."""
    with pytest.raises(ValueError) as err:
        validate(_compose([override]))
    assert str(err.value) == message


@pytest.mark.parametrize("override,message", [
    ("offload.buffer_count=-3", "offload.buffer_count=-3 is invalid; expected an integer >= 1"),
    ("offload.sub_group_size=0", "offload.sub_group_size=0 is invalid; expected an integer >= 1"),
    ("offload.aio.queue_depth=0", "offload.aio.queue_depth=0 is invalid; expected an integer >= 1"),
])
def test_offload_values_are_checked_whatever_the_device(override, message):
    """Issue 45 item 10: ``+offload=cpu offload.buffer_count=-3 offload.sub_group_size=0`` trained:
    validate_config checked those values only under offload=nvme."""
    with pytest.raises(ValueError) as err:
        validate(_compose(["+zero=stage2", "+offload=cpu", override]))
    assert str(err.value) == message


@pytest.mark.parametrize("override,message", [
    ("checkpoint.async_save=2", "checkpoint.async_save=2: must be true or false"),
    ("ac_offload=2", "ac_offload=2: must be true or false"),
    ("ac_offload=yes", "ac_offload='yes': must be true or false"),
    ("+zero=stage2 zero.overlap_comm=0", "zero.overlap_comm=0: must be true or false"),
    ("+offload=cpu +zero=stage2 offload.aio.single_submit=1", "offload.aio.single_submit=1: must be true or false"),
])
def test_switches_take_only_true_or_false(override, message):
    """Issue 45 item 10: ``checkpoint.async_save=2`` and ``ac_offload=2`` were taken as true (OmegaConf's
    bool converts any integer, and yes/on); a switch now holds true or false, or the key is named."""
    with pytest.raises(ValueError) as err:
        validate(_compose(override.split()))
    assert str(err.value) == message
    assert validate(_compose(["ac_offload=true", "checkpoint.async_save=false"])).engine.ac_offload is True


@pytest.mark.parametrize("value", ["4097", "99999999999999999999999"])
def test_local_worker_count_is_bounded(value):
    """Issue 45 item 8 (the app's side): ``launcher.nproc_per_node=300000000`` validated, and the app
    would then start that many workers; the launcher's bound (4096 workers per node) holds here too."""
    with pytest.raises(ValueError) as err:
        validate(_compose([f"launcher.nproc_per_node={value}"]))
    assert str(err.value) == f"launcher.nproc_per_node={value}: at most 4096 workers per node (the launcher's bound)"


def test_cli_exits_nonzero_with_one_line_before_any_work(tmp_path):
    proc = run_main(["train.micro_batch_size=0", f"hydra.run.dir={tmp_path}"], cwd=Path.cwd(), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: train.micro_batch_size=0: must be a positive integer"]
    assert not (tmp_path / "tensorboard").exists()  # nothing started


def test_ac_auto_is_the_default_and_resolves_before_workers():
    """``ac`` left out means auto: no checkpointing unless memory needs it (preflight decides, see
    tests/offload/test_working_set_estimate.py); ``ac_offload`` alone asks for every block; a given
    value is kept and never changed."""
    auto = validate(_compose([]))
    assert (auto.engine.ac, auto.ac_auto) == ("none", True)
    offloaded = validate(_compose(["ac_offload=true"]))
    assert (offloaded.engine.ac, offloaded.ac_auto) == ("full", False)
    for given in ("none", "full", "every_2"):
        s = validate(_compose([f"ac={given}"]))
        assert (s.engine.ac, s.ac_auto) == (given, False)
    with pytest.raises(ValueError, match=r"ac='sometimes': valid values are \['auto', 'none', 'full', 'every_2'\]"):
        validate(_compose(["ac=sometimes"]))
