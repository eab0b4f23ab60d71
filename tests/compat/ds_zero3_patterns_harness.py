"""Issue 34: ZeRO-3 patterns DeepSpeed scripts write, with ``import deepshard.compat.deepspeed as deepspeed``.

``pretrained_main``: DeepSpeed's documented way to load pretrained weights into a ``zero.Init()`` model
(docs "Constructing Massive Models"): build under ``zero.Init()``, rank 0 writes the weights inside
``zero.GatheredParameters(..., modifier_rank=0)``, then ``initialize`` and train.  ``how`` picks the
write: ``model.load_state_dict(sd)`` or ``p.data.copy_(...)`` per parameter.
``save_zero_three_model`` is DeepSpeed-Chat's dschat/utils/utils.py function, line for line (its
``_z3_params_to_fetch`` too), run after training at ZeRO-3.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F  # noqa: N812

import deepshard.compat.deepspeed as deepspeed
from deepshard.compat.deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

VOCAB = 37
DS_CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.0}},
             "zero_optimization": {"stage": 3}}


class TinyLM(nn.Module):
    """Blocks in a ModuleList (gathered per block), odd row counts (shards of unequal size)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 10)
        self.layers = nn.ModuleList([nn.Linear(10, 10), nn.Linear(10, 10)])
        self.norm = nn.LayerNorm(10)
        self.head = nn.Linear(10, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(self.norm(x))


def pretrained_state() -> dict[str, torch.Tensor]:
    """The 'pretrained checkpoint': a TinyLM built from another seed than the run's."""
    torch.manual_seed(7)
    return TinyLM().state_dict()


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 + 2 * step + rank)
    tokens = torch.randint(VOCAB, (4, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def pretrained_main(how: str, steps: int):
    deepspeed.init_distributed()
    rank = torch.distributed.get_rank()
    sd = pretrained_state() if rank == 0 else None
    torch.manual_seed(0)
    with deepspeed.zero.Init():
        model = TinyLM()
    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
        if rank == 0:
            if how == "load_state_dict":
                model.load_state_dict(sd)
            else:
                for n, p in model.named_parameters():
                    p.data.copy_(sd[n])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS_CONFIG)
    losses = []
    for step in range(steps):
        inputs, labels = batch(step, rank)
        loss = F.cross_entropy(engine(inputs).flatten(0, 1), labels.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return engine, losses


def _z3_params_to_fetch(param_list):
    return [p for p in param_list if hasattr(p, 'ds_id') and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    zero_stage_3 = (zero_stage == 3)
    os.makedirs(save_dir, exist_ok=True)
    WEIGHTS_NAME = "pytorch_model.bin"  # noqa: N806 - DeepSpeed-Chat's spelling
    output_model_file = os.path.join(save_dir, WEIGHTS_NAME)

    model_to_save = model_ema.module if hasattr(model_ema, 'module') else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
    else:
        output_state_dict = {}
        for k, v in model_to_save.named_parameters():

            if hasattr(v, 'ds_id'):
                with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=zero_stage_3):
                    v_p = v.data.cpu()
            else:
                v_p = v.cpu()
            if global_rank == 0 and "lora" not in k:
                output_state_dict[k] = v_p
        if global_rank == 0:
            torch.save(output_state_dict, output_model_file)
        del output_state_dict


def run_all(save_dir: str) -> dict:
    out = {}
    engine, out["losses_load_state_dict"] = pretrained_main("load_state_dict", steps=3)
    rank = torch.distributed.get_rank()
    save_zero_three_model(engine, rank, save_dir, zero_stage=3)
    out["still_sharded"] = all(hasattr(p, "to_local") for p in engine.module.parameters())
    inputs, labels = batch(3, rank)  # training goes on after the save
    loss = F.cross_entropy(engine(inputs).flatten(0, 1), labels.flatten())
    engine.backward(loss)
    engine.step()
    out["loss_after_save"] = loss.item()
    _, out["losses_copy"] = pretrained_main("copy_", steps=1)
    return out
