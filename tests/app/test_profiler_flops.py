"""MFU counts every micro-batch of a step: ``train.grad_accum`` of them, or under pipeline parallelism
``pipeline.microbatches`` (the FLOPs were once multiplied by grad_accum there, making MFU under pp
too low by the microbatch count).  The oracle: PaLM's count of one micro-batch by hand, written here
(``test_mfu.py`` checks the count itself)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from deepshard.finetune.config import register, validate
from deepshard.finetune.recipe.assemble import step_flops

CONF = Path(__file__).resolve().parents[2] / "conf"
SMALL = ["model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=128",
         "data.seq_len=32", "train.micro_batch_size=2"]
register()


def _settings(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=[*SMALL, *overrides])
    return validate(OmegaConf.to_container(cfg, resolve=True))


def _flops_per_step(settings) -> int:
    return step_flops(settings)


def _one_micro_batch_flops(settings) -> int:
    layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128) + 2 * 64  # q, k/v (2 kv heads of 16), o, MLP, norms
    dense = 4 * layer + 64 + settings.model.vocab_size * 64  # + final norm and head (the embedding is a lookup)
    return (6 * dense + 12 * 4 * 4 * 16 * 32) * 2 * 32  # + attention; x 2 rows of 32 tokens


def test_flops_per_step_count_grad_accum_micro_batches():
    s = _settings(["train.grad_accum=4", "launcher.nproc_per_node=2"])
    assert _flops_per_step(s) == 4 * _one_micro_batch_flops(s)


def test_flops_per_step_count_pipeline_microbatches_per_pp_rank():
    s = _settings(["parallel.pp=2", "pipeline.microbatches=4", "pipeline.schedule=gpipe", "launcher.nproc_per_node=2"])
    assert s.train.grad_accum == 1 and s.micro_batches_per_step == 4
    # each of the 2 pp ranks computes half of the 4 microbatches' FLOPs
    assert _flops_per_step(s) == 4 * _one_micro_batch_flops(s) // 2
