"""The ds_config through the app's one translation: errors name the file and its key, the batch
hint says which change makes it consistent at this world size, DeepSpeed's defaults and its
LR schedule, one update late as its engine applies it (no process group needed)."""

from __future__ import annotations

import json
import math

import pytest

from deepshard.compat.deepspeed.config import compat_config
from deepshard.core import SchedulerConfig
from deepshard.core.schedules import LRSchedule


def test_batch_mismatch_names_the_file_its_keys_and_the_fix(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                "gradient_accumulation_steps": 1, "optimizer": {"type": "AdamW"}}))
    with pytest.raises(ValueError) as err:
        compat_config(str(path), dp=2, cuda=False)
    msg = str(err.value)
    assert msg.startswith("ds_config.json: train_batch_size=16 != train_micro_batch_size_per_gpu=4 x "
                          "gradient_accumulation_steps=1 x data-parallel size 2 = 8")
    assert "at world size 2: set train_batch_size=8 or gradient_accumulation_steps=2" in msg
    assert "train.global_batch_size" not in msg


def test_bad_value_names_the_ds_key():
    with pytest.raises(ValueError, match=r"^ds_config: optimizer.params.lr=-1: must be > 0"):
        compat_config({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, dp=1, cuda=False)
    with pytest.raises(ValueError, match=r"^ds_config: gradient_clipping=-1"):
        compat_config({"optimizer": {"type": "AdamW"}, "gradient_clipping": -1}, dp=1, cuda=False)


@pytest.mark.parametrize("config, expected", [
    ({"train_micro_batch_size_per_gpu": "eight"}, "train_micro_batch_size_per_gpu='eight': expected a positive "),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, "optimizer.params.lr='fast': expected a number"),
    ({"fp16": {"enabled": True, "initial_scale_power": "big"}}, "fp16.initial_scale_power='big': expected an int"),
    ({"optimizer": "adam"}, "optimizer='adam': expected a JSON object"),
])
def test_value_of_the_wrong_type_names_the_ds_key(config, expected):
    """deepspeed.initialize(config=...): a ValueError in the ds_config's own words, not a TypeError."""
    with pytest.raises(ValueError) as err:
        compat_config(config, dp=1, cuda=False)
    assert str(err.value).startswith(f"ds_config: {expected}"), str(err.value)


def test_integer_sizes_written_as_1e9_are_taken_as_deepspeed_takes_them():
    """DeepSpeed's stock configs write ``"sub_group_size": 1e9``: a JSON float DeepSpeed reads as an int.
    Since offload checks its values whatever the device, the float was refused (issue 45's check)."""
    from deepshard.offload import OffloadConfig, validate_config

    ds = {"optimizer": {"type": "AdamW"}, "zero_optimization": {
        "stage": 3, "sub_group_size": 1e9, "offload_optimizer": {"device": "cpu"}}}
    offload = compat_config(ds, dp=1, cuda=False).offload
    assert offload["sub_group_size"] == 10**9 and type(offload["sub_group_size"]) is int
    validate_config(OffloadConfig(**offload))
    ds["zero_optimization"]["sub_group_size"] = 1500.5  # not a whole number: still refused, by its key
    with pytest.raises(ValueError, match=r"offload.sub_group_size=1500.5 is invalid"):
        validate_config(OffloadConfig(**compat_config(ds, dp=1, cuda=False).offload))


def test_switches_written_as_1_or_0_are_taken_as_deepspeed_takes_them():
    """DeepSpeed reads ``"overlap_comm": 1`` and ``"enabled": 1`` as true; the app's switches take only
    true/false (issue 45), so the translation reads DeepSpeed's as DeepSpeed does."""
    from deepshard.compat.ds_config import translate

    t = translate({"zero_optimization": {"stage": 2, "overlap_comm": 0},
                   "activation_checkpointing": {"cpu_checkpointing": 1}, "fp16": {"enabled": 1}})
    assert t.entries["zero.overlap_comm"] == ("value", False)
    assert t.entries["ac_offload"] == ("value", True)
    assert t.entries["precision"][1] == "fp16"  # "enabled": 1 turned fp16 on, as in DeepSpeed
    t = translate({"zero_optimization": {"stage": 2, "overlap_comm": 2}})  # not a switch value: kept, refused later
    assert t.entries["zero.overlap_comm"] == ("value", 2)


def test_unsupported_keys_one_warning_line(capsys):
    compat_config({"optimizer": {"type": "AdamW"}, "comms_logger": {"enabled": True}, "amp": {"enabled": True}},
                  dp=1, cuda=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: ds_config: not supported, ignored: comms_logger, amp"]


def test_fixture_translates_with_deepspeed_defaults():
    from pathlib import Path

    fixtures = Path(__file__).resolve().parents[1] / "finetune_app" / "fixtures"
    z2 = compat_config(str(fixtures / "ds_zero2_fp16.json"), dp=2, cuda=False)
    assert (z2.micro_batch_size, z2.grad_accum, z2.train_batch_size) == (4, 2, 16)
    e = z2.engine
    assert e.zero.stage == 2 and e.precision.dtype == "fp32" and z2.fp16_on_cpu  # fp16 -> fp32 on CPU
    assert e.optim.betas == (0.8, 0.999) and e.optim.grad_clip == 1.0
    assert e.scheduler.name == "WarmupLR" and e.scheduler.warmup_type == "log"  # DeepSpeed's default
    z3 = compat_config(str(fixtures / "ds_zero3_offload.json"), dp=2, cuda=False, warn=False)
    assert z3.engine.zero.stage == 3 and z3.offload["device"] == "cpu" and z3.offload["params"] == "cpu"
    plain = compat_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}}, dp=2, cuda=False)
    # DeepSpeed's: gradient_clipping defaults to 1.0 in 0.19.8 (runtime/constants.py GRADIENT_CLIPPING_DEFAULT)
    assert plain.engine.optim.grad_clip == 1.0 and plain.engine.optim.betas == (0.9, 0.999)
    assert plain.train_batch_size == 4


def _ds_rate(name: str, it: int, c: SchedulerConfig, base: float) -> float:
    """deepspeed/runtime/lr_schedules.py's get_lr at last_batch_iteration ``it`` (written out; the
    recorded runs of tests/core/test_lr_schedule_vs_deepspeed.py check the engine's order)."""
    if it < 0:
        return 0.0 if name == "WarmupCosineLR" else c.warmup_min_lr
    if it < c.warmup_num_steps:
        gamma = math.log(it + 1) / math.log(c.warmup_num_steps)
    elif name == "WarmupLR":
        gamma = 1.0
    else:
        gamma = max(0.0, (c.total_num_steps - it) / max(1.0, c.total_num_steps - c.warmup_num_steps))
    return c.warmup_min_lr + (c.warmup_max_lr - c.warmup_min_lr) * gamma


@pytest.mark.parametrize("name", ["WarmupLR", "WarmupDecayLR"])
def test_lr_of_update_k_is_deepspeeds_one_update_late(name):
    c = SchedulerConfig(name=name, warmup_min_lr=1e-5, warmup_max_lr=1e-3, warmup_num_steps=4,
                        warmup_type="log", total_num_steps=10)
    schedule = LRSchedule(c, 1e-3)  # core's own schedule: no adapter in the compat layer any more
    for k in range(12):  # DeepSpeed's engine steps its scheduler after the k-th update
        assert schedule.lr_at(k) == pytest.approx(_ds_rate(name, k - 1, c, 1e-3), abs=1e-12)


def test_warmup_lr_peaks_at_the_optimizers_lr_by_default():
    """DeepSpeed's WarmupLR takes warmup_max_lr=None as the optimizer's lr (WarmupDecayLR: 0.001)."""
    ds = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 5e-3}}}
    warm = compat_config({**ds, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}},
                         dp=1, cuda=False, warn=False).engine.scheduler
    assert warm.warmup_max_lr == 5e-3
    decay = compat_config({**ds, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 9,
                                                                                   "warmup_num_steps": 2}}},
                          dp=1, cuda=False, warn=False).engine.scheduler
    assert decay.warmup_max_lr == 1e-3
