"""zero.Init, zero.GatheredParameters, save_checkpoint/load_checkpoint (``latest``, client_state) and
save_16bit_model through ``deepshard.compat.deepspeed``, on one rank of a real gloo group."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.compat.compat_harness import batches, tiny_llama, tokenizer

LR_CASE = 3  # tests/core/fixtures/ds_lr_schedules.json: the WarmupDecayLR DeepSpeed saved and resumed
FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "core" / "fixtures" / "ds_lr_schedules.json").read_text())
DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
      "optimizer": {"type": "AdamW", "params": {"lr": FIXTURE["cases"][LR_CASE]["base_lr"], "weight_decay": 0.0}},
      "scheduler": {"type": FIXTURE["cases"][LR_CASE]["name"], "params": FIXTURE["cases"][LR_CASE]["params"]},
      "zero_optimization": {"stage": 3}}


def _engine(init: bool):
    import deepshard.compat.deepspeed as deepspeed

    deepspeed.init_distributed()
    if init:
        with deepspeed.zero.Init():
            model = tiny_llama(len(tokenizer()))
    else:
        model = tiny_llama(len(tokenizer()))
    meta = all(p.is_meta for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DS)
    return engine, meta


def _train(engine, n: int, offset: int, lrs: list[float]) -> list[float]:
    out = []
    data = list(batches(engine.global_rank, engine.world_size, 2, offset + n, engine.device))[offset:]
    for inputs in data:
        lrs.append(engine.get_lr()[0])  # the rate this update runs at, as DeepSpeed's get_lr()
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def checkpoint_worker(save_dir: str) -> dict:
    import deepshard.compat.deepspeed as deepspeed

    engine, meta = _engine(init=True)
    rank = deepspeed.comm.get_rank()
    tokens = engine.module.model.embed_tokens
    embed = tokens.weight
    full_numel = embed.shape.numel()
    local_numel = embed.to_local().numel()
    with deepspeed.zero.GatheredParameters([embed], modifier_rank=0):
        gathered_shape = tuple(tokens.weight.to_local().shape) if hasattr(tokens.weight, "to_local") \
            else tuple(tokens.weight.shape)
        if rank == 0:
            tokens.weight.data[0].fill_(0.5)  # kept: modifier_rank=0
        else:
            tokens.weight.data[1].fill_(9.0)  # discarded: not the modifier
    with deepspeed.zero.GatheredParameters([embed]):
        row0, row1 = tokens.weight.data[0].clone(), tokens.weight.data[1].clone()
    masters = engine.optimizer.store.state_dict()["master"]
    master0 = next(m for m, p in zip(masters, engine.engine.stage.params) if p is embed)
    lrs: list[float] = []
    first = _train(engine, 2, 0, lrs)
    engine.save_checkpoint(save_dir, client_state={"epoch": 3, "note": "hi"})
    latest = (Path(save_dir) / "latest").read_text()
    after = _train(engine, 2, 2, lrs)
    engine.save_16bit_model(save_dir, "model.safetensors")
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        final = {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    fresh, _ = _engine(init=False)  # a plain build, then the checkpoint
    path, client = fresh.load_checkpoint(save_dir)
    steps = fresh.global_steps
    resumed_lrs: list[float] = []
    resumed = _train(fresh, 2, 2, resumed_lrs)
    saved = {}
    if rank == 0:
        from safetensors.torch import load_file

        saved = load_file(str(Path(save_dir) / "model.safetensors"))
    return {"meta": meta, "full": full_numel, "local": local_numel, "gathered_shape": gathered_shape,
            "row0": row0.tolist(), "row1_is_9": bool((row1 == 9.0).all()), "master_row0": master0[0].tolist() if rank == 0 else None,
            "first": first, "after": after, "resumed": resumed, "latest": latest, "path": path,
            "client": client, "steps": steps, "lr": fresh.get_lr(),
            "lrs": lrs, "resumed_lrs": resumed_lrs,
            "saved_match": all(torch.equal(saved[k], final[k]) for k in final) if rank == 0 else True,
            "saved_keys": sorted(saved) == sorted(final) if rank == 0 else True}
