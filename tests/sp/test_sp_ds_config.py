"""DeepSpeed's ``sequence_parallel_size`` (Ulysses / ALST) maps to ``parallel.sp``, and reaches the app's
checks through ``+deepspeed=ds_config.json`` (in-process, no launch)."""

from __future__ import annotations

import json

import pytest

from deepshard.compat.ds_config import translate
from tests.app.prelaunch import prelaunch_error


def test_sequence_parallel_size_maps_to_parallel_sp():
    t = translate({"sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": 1})
    assert "parallel.sp=2" in t.overrides and not t.unsupported
    assert t.origin["parallel.sp"] == ("sequence_parallel_size", 2)
    assert "parallel.sp" not in translate({"sequence_parallel_size": "auto"}).entries
    with pytest.raises(ValueError, match="sequence_parallel_size=0"):
        translate({"sequence_parallel_size": 0})


def test_ds_config_sequence_parallel_size_reaches_the_app_checks(tmp_path, monkeypatch):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": 1}))
    from deepshard.finetune.config.ds_config import merge_argv

    argv, _ = merge_argv(["main.py", f"+deepspeed={ds}", "launcher.nproc_per_node=2", "data.seq_len=63"])
    assert "parallel.sp=2" in argv
    line = prelaunch_error(argv[1:], tmp_path / "run", monkeypatch)
    assert "data.seq_len=63 is not divisible by parallel.sp=2" in line, line


def test_cpu_checkpointing_maps_to_ac_offload():
    """``activation_checkpointing.cpu_checkpointing`` is our ``ac_offload``, for the app and for
    deepshard.compat.deepspeed's engine config alike."""
    from deepshard.compat.deepspeed.config import engine_config

    t = translate({"activation_checkpointing": {"cpu_checkpointing": True}})
    assert {"ac=full", "ac_offload=true"} <= set(t.overrides) and not t.unsupported
    config = engine_config(t.sections(), grad_accum=1)
    assert (config.ac, config.ac_offload) == ("full", True)


def test_compat_deepspeed_refuses_sequence_parallel_size():
    """deepshard.compat.deepspeed trains the user's own model, whose attention it cannot split: refused,
    pointing at the app, rather than silently training without sequence parallelism."""
    from deepshard.compat.deepspeed.config import compat_config

    with pytest.raises(ValueError, match=r"sequence_parallel_size=2: .* parallel.sp=N"):
        compat_config({"sequence_parallel_size": 2, "train_micro_batch_size_per_gpu": 1}, dp=1, cuda=False)
    assert compat_config({"sequence_parallel_size": 1}, dp=1, cuda=False).engine.ac == "none"
