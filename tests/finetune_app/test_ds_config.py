"""ds_config.json -> overrides: DeepSpeed's documented configs map, unsupported keys are named once,
the command line wins, and DeepSpeed's batch arithmetic (with its contradictions) holds."""

from __future__ import annotations

import json

import pytest

from deepshard.compat.resolve import fp16_fallback, resolve_batch
from deepshard.finetune.config.ds_config import main, merge_argv, translate
from tests.finetune_app.app_harness import FIXTURES


def _load(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def test_zero2_fp16_fixture_maps_every_key():
    t = translate(_load("ds_zero2_fp16.json"))
    assert t.overrides == [
        "train.global_batch_size=16", "train.micro_batch_size=4", "train.grad_accum=0",
        "optim.betas=[0.8,0.999]", "optim.lr=0.001", "optim.eps=1e-08", "optim.weight_decay=3e-07",
        "scheduler=warmup", "scheduler.warmup_min_lr=0", "scheduler.warmup_max_lr=0.001",
        "scheduler.warmup_num_steps=2", "scheduler.warmup_type=log", "precision=fp16", "precision.loss_scale=0",
        "precision.initial_scale_power=16", "precision.loss_scale_window=1000", "precision.hysteresis=2",
        "precision.consecutive_hysteresis=false", "precision.min_loss_scale=1", "+zero=stage2", "zero.allgather_bucket_size=500000000",
        "zero.overlap_comm=true", "zero.reduce_bucket_size=500000000", "optim.grad_clip=1", "train.log_every=2",
    ]
    assert t.unsupported == []


def test_zero3_offload_fixture_maps_and_names_the_rest():
    t = translate(_load("ds_zero3_offload.json"))
    for o in ("+zero=stage3", "+offload=cpu", "offload.params=cpu", "offload.sub_group_size=1000000000",
              "zero.prefetch=1", "zero.reduce_bucket_size=10000000", "scheduler=warmup_decay",
              "scheduler.total_num_steps=6", "train.micro_batch_size=4", "train.grad_accum=1",
              "train.tensorboard_dir=ds_logs/zero3_offload"):
        assert o in t.overrides, (o, t.overrides)
    # bf16.enabled=false: fp32, as DeepSpeed trains it (not our precision=auto, bf16 on a GPU)
    assert [o for o in t.overrides if o.startswith("precision=")] == ["precision=fp32"]
    assert t.unsupported == ["comms_logger"]
    # saves always gather (one tensor at a time); the compat engine reports the key to transformers/accelerate
    assert any("stage3_gather_16bit_weights_on_model_save" in n for n in t.notes)
    assert any("stage3_param_persistence_threshold" in n for n in t.notes)


def test_nvme_aio_and_odd_keys():
    t = translate({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/mnt/nv",
                                                                           "buffer_count": 4, "pipeline_read": True}},
                   "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                           "overlap_events": True, "use_gds": False},
                   "optimizer": {"type": "Lamb", "params": {"lr": "auto"}},
                   "scheduler": {"type": "OneCycle"}, "activation_checkpointing": {"partition_activations": True},
                   "wall_clock_breakdown": True, "train_micro_batch_size_per_gpu": "auto"})
    for o in ("+offload=nvme", "offload.nvme_path=/mnt/nv", "offload.buffer_count=4",
              "offload.aio.overlap_events=true", "offload.aio.block_size=1048576", "offload.aio.single_submit=false",
              "ac=full", "profile.enabled=true"):
        assert o in t.overrides, (o, t.overrides)
    assert not any(o.startswith(("optim.lr", "train.")) for o in t.overrides)  # "auto" keeps the app's value
    assert t.unsupported == ["optimizer.type=Lamb", "scheduler.type=OneCycle", "aio.use_gds",
                             "activation_checkpointing.partition_activations"]


def test_unsupported_keys_in_one_warning_strict_errors_and_command_line_wins(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
                                "fp16": {"enabled": True}, "comms_logger": {"enabled": True}, "amp": {"enabled": True},
                                "steps_per_print": 5}))
    argv, _ = merge_argv(["main.py", f"+deepspeed={path}", "+zero=stage3", "train.log_every=7"])
    assert argv == ["main.py", "precision=fp16", "zero.reduce_bucket_size=1000", "+zero=stage3", "train.log_every=7"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: deepspeed={path}: not supported, ignored: comms_logger, amp"]
    with pytest.raises(ValueError, match=r"not supported, ignored: comms_logger, amp \(deepspeed\.strict"):
        merge_argv(["main.py", f"+deepspeed={path}", "deepspeed.strict=true"])
    assert merge_argv(["main.py", "x=1"])[0] == ["main.py", "x=1"]


@pytest.mark.parametrize(("ds", "named"), [({"prescale_gradients": True}, "prescale_gradients"),
                                           ({"optimizer": {"type": "Lamb"}}, "optimizer.type=Lamb"),
                                           ({"curriculum_learning": {"enabled": True}}, "curriculum_learning")])
def test_result_changing_key_stops_naming_the_file_and_key(tmp_path, capsys, ds, named):
    """Ignoring these would change the numbers: one line before Hydra (main.py prints it, exit 2), no warning."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "amp": {"enabled": True}, **ds}))
    with pytest.raises(ValueError) as err:
        merge_argv(["main.py", f"+deepspeed={path}"])
    assert str(err.value) == (f"deepspeed={path}: {named}: not supported by deepshard, and ignoring it would change "
                              f"the results; remove it")
    assert capsys.readouterr().err == ""


def test_cli_prints_overrides(capsys):
    assert main([str(FIXTURES / "ds_zero2_fp16.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("train.global_batch_size=16 train.micro_batch_size=4 train.grad_accum=0 ")
    assert "'optim.betas=[0.8,0.999]'" in out and "+zero=stage2" in out
    assert main([str(FIXTURES / "missing.json")]) == 2


@pytest.mark.parametrize("g,m,a,dp,expect", [
    (16, 4, 0, 2, (4, 2)), (16, 0, 2, 2, (4, 2)), (16, 0, 1, 4, (4, 1)), (16, 2, 4, 2, (2, 4)), (0, 3, 5, 2, (3, 5)),
])
def test_batch_triple_any_two_fix_the_third(g, m, a, dp, expect):
    train = {"global_batch_size": g, "micro_batch_size": m, "grad_accum": a}
    resolve_batch(train, dp)
    assert (train["micro_batch_size"], train["grad_accum"]) == expect


def test_contradictory_batch_triple_shows_the_numbers():
    with pytest.raises(ValueError, match=r"train\.global_batch_size=32 != train\.micro_batch_size=4 x "
                                         r"train\.grad_accum=2 x data-parallel size 2 = 16"):
        resolve_batch({"global_batch_size": 32, "micro_batch_size": 4, "grad_accum": 2}, 2)
    with pytest.raises(ValueError, match=r"train\.global_batch_size=10 is not divisible by "
                                         r"train\.micro_batch_size=4 x data-parallel size 2 = 8"):
        resolve_batch({"global_batch_size": 10, "micro_batch_size": 4, "grad_accum": 0}, 2)


def test_fp16_falls_back_to_fp32_on_a_cpu_host(capsys):
    cfg = {"precision": {"dtype": "fp16"}}
    assert fp16_fallback(cfg, cuda=False) and cfg["precision"]["dtype"] == "fp32"
    assert "notice: precision=fp16 needs a CUDA device" in capsys.readouterr().err
    cfg = {"precision": {"dtype": "fp16"}}
    assert not fp16_fallback(cfg, cuda=True) and cfg["precision"]["dtype"] == "fp16"


def test_consecutive_hysteresis_and_communication_dtype_map():
    t = translate({"fp16": {"enabled": True, "consecutive_hysteresis": True}, "communication_data_type": "bf16",
                   "data_types": {"grad_accum_dtype": "fp32"}})
    assert "precision.consecutive_hysteresis=true" in t.overrides
    assert "zero.reduce_dtype=bf16" in t.overrides
    assert t.unsupported == []
    t = translate({"data_types": {"grad_accum_dtype": "bf16"}})
    assert t.unsupported == ["data_types.grad_accum_dtype=bf16"]  # we always accumulate in fp32
    with pytest.raises(ValueError, match="communication_data_type='int8'"):
        translate({"communication_data_type": "int8"})
