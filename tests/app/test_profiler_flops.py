"""MFU counts every micro-batch of a step: ``train.grad_accum`` of them, or under pipeline parallelism
``pipeline.microbatches`` (the FLOPs were once multiplied by grad_accum there, making MFU under pp
too low by the microbatch count).  The oracle: FlopCounterMode on a plain torch model of one
micro-batch, written here."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from deepshard.finetune.config import register, validate
from deepshard.finetune.models.llama import Llama
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
    model = Llama(settings.model).to("meta")
    x = torch.zeros(settings.train.micro_batch_size, settings.data.seq_len, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        model(x, x).backward()
    return counter.get_total_flops()


def test_flops_per_step_count_grad_accum_micro_batches():
    s = _settings(["train.grad_accum=4", "launcher.nproc_per_node=2"])
    assert _flops_per_step(s) == 4 * _one_micro_batch_flops(s)


def test_flops_per_step_count_pipeline_microbatches_per_pp_rank():
    s = _settings(["parallel.pp=2", "pipeline.microbatches=4", "pipeline.schedule=gpipe", "launcher.nproc_per_node=2"])
    assert s.train.grad_accum == 1 and s.micro_batches_per_step == 4
    # each of the 2 pp ranks computes half of the 4 microbatches' FLOPs
    assert _flops_per_step(s) == 4 * _one_micro_batch_flops(s) // 2
