"""Resume imported DeepSpeed checkpoints with deepshard.compat.deepspeed on one rank of a gloo group."""

from __future__ import annotations

import torch
from ds_fixture_model import MICRO, SAVE_STEP, TOTAL_STEPS, ds_config, global_batch, tiny_model


def resume_worker(imported: dict[int, str], stages: dict[int, int]) -> dict[int, list[float]]:
    """For each DeepSpeed stage: a fresh engine (other weights) at our ZeRO stage ``stages[ds_stage]``,
    ``load_checkpoint(imported dir)``, then DeepSpeed's next steps; the global batch's mean loss per step."""
    import deepshard.compat.deepspeed as deepspeed

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    rows = 2 * MICRO // world
    out = {}
    for ds_stage, path in imported.items():
        model = tiny_model(seed=1)
        cfg = ds_config(stages[ds_stage], world)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        loaded, _ = engine.load_checkpoint(path)
        assert loaded is not None and engine.global_steps == SAVE_STEP
        losses = []
        for step in range(SAVE_STEP, TOTAL_STEPS):
            tokens = global_batch(step)[rank * rows:(rank + 1) * rows].to(engine.device)
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
        out[ds_stage] = losses
    return out
