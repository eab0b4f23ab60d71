"""The app's pipeline / tensor-parallel path: it trains, it logs the global loss, and bad layouts
fail before any work with the key named (parity itself is proven in tests/pipeline)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from deepshard.finetune.config import register, validate
from tests.app.prelaunch import prelaunch_error
from tests.app_runner import run_main

ROOT = Path(__file__).resolve().parents[2]
# a ~0.3M-parameter Llama, one layer per pipeline stage: the schedule and the logging are what is checked
TINY = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
        "data.seq_len=64", "data.num_docs=600", "optim.lr=0.01"]
register()


def _validate(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    return validate(OmegaConf.to_container(cfg, resolve=True))


@pytest.mark.parametrize("overrides,key", [
    (["parallel.pp=8", "pipeline.microbatches=8"], "model.n_layers"),  # 8 stages > 6 layers
    (["parallel.tp=3"], "parallel.tp"),
    (["parallel.pp=2", "pipeline.microbatches=1"], "pipeline.microbatches"),
    (["parallel.pp=2", "pipeline.schedule=interleaved_1f1b", "pipeline.microbatches=3"], "pipeline.microbatches"),
    (["parallel.pp=2", "pipeline.schedule=dualpipe"], "pipeline.schedule"),
])
def test_bad_parallel_layouts_name_the_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        _validate(overrides)


@pytest.mark.parametrize("overrides", [
    ["parallel.pp=2", "train.grad_accum=2", "data.eval_fraction=0.1", "train.sample_prompt=hi", "data.doc_mask=true"],
    ["parallel.tp=2", "train.grad_accum=2", "data.eval_fraction=0.1", "train.sample_prompt=hi", "data.doc_mask=true"],
])
def test_pp_and_tp_take_what_the_data_parallel_run_takes(overrides):
    s = _validate(overrides)  # once refused under pp/tp: accumulation, eval, the sample, document masks
    pp = s.pipeline.microbatches if s.parallel.pp > 1 else 1  # pp: the schedule runs microbatches x grad_accum
    assert s.micro_batches_per_step == 2 * pp


def test_a_global_batch_under_pp_counts_the_pipeline_microbatches():
    """train.global_batch_size is every row of a step: micro x grad_accum x pipeline.microbatches x dp."""
    s = _validate(["parallel.pp=2", "pipeline.microbatches=2", "train.global_batch_size=16",
                   "train.micro_batch_size=2", "train.grad_accum=0", "launcher.nproc_per_node=2"])
    assert s.train.grad_accum == 4
    assert s.tokens_per_step(s.parallel.dp) == 16 * s.data.seq_len


def test_a_world_size_the_layout_does_not_divide_fails_before_launch(tmp_path, monkeypatch):
    line = prelaunch_error(["parallel.pp=3"], tmp_path / "run", monkeypatch)  # the launcher's checks, in-process
    assert "parallel.pp=3" in line and "world size 2" in line


@pytest.mark.slow
def test_pipeline_run_trains(tmp_path):
    proc = run_main(["parallel.pp=2", "train.max_steps=8", "train.log_every=4", "pipeline.schedule=gpipe", *TINY,
                     f"hydra.run.dir={tmp_path}"], cwd=Path.cwd(), timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "2 rank(s) (pp 2 x dp 1 x tp 1)" in out
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and losses[-1] < losses[0] - 0.5
