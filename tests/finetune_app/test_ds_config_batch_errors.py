"""The app's ``+deepspeed=ds_config.json`` at world 2 with DeepSpeed's common ZeRO-2 example
(train_batch_size 16, micro batch 4, accumulation 4: right for 1 GPU, 32 rows at 2): the run stops
before any worker starts with one line in the file's own keys and the changes that fix it at this world
size, as ``deepshard.compat.deepspeed`` says it (issue 30).  A key given on the command line instead
keeps its ``train.*`` name."""

from __future__ import annotations

import json
import os

from tests.app_runner import run_main

TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "data.seq_len=64"]
ZERO2 = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
         "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def _run(tmp_path, *overrides: str) -> tuple[int, list[str], str]:
    (tmp_path / "ds_config.json").write_text(json.dumps(ZERO2))
    run = tmp_path / "run"
    proc = run_main(["+deepspeed=ds_config.json", "launcher.nproc_per_node=2", *TINY, *overrides,
                     f"hydra.run.dir={run}"], cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert not (run / "heartbeat").exists() and not (run / "launcher.log").exists()  # no worker started
    return proc.returncode, proc.stderr.strip().splitlines(), proc.stderr


def test_the_batch_triple_of_a_ds_config_is_refused_in_the_files_keys(tmp_path):
    code, lines, err = _run(tmp_path)
    assert code == 2, err[-3000:]
    assert lines[-1] == (
        "error: ds_config.json: train_batch_size=16 != train_micro_batch_size_per_gpu=4 x "
        "gradient_accumulation_steps=4 x data-parallel size 2 = 32: give two of the three, or make them agree "
        "(at data-parallel size 2: set train_batch_size=32 or gradient_accumulation_steps=2 or "
        "train_micro_batch_size_per_gpu=2)"), err[-3000:]
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in err


def test_a_batch_key_given_on_the_command_line_keeps_its_own_name(tmp_path):
    code, lines, err = _run(tmp_path, "train.grad_accum=3")
    assert code == 2, err[-3000:]
    assert lines[-1] == (
        "error: ds_config.json: train_batch_size=16 != train_micro_batch_size_per_gpu=4 x train.grad_accum=3 x "
        "data-parallel size 2 = 24: give two of the three, or make them agree (at data-parallel size 2: set "
        "train_batch_size=24 or train.grad_accum=2)"), err[-3000:]
