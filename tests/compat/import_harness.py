"""Resume imported DeepSpeed checkpoints with deepshard.compat.deepspeed on one rank of a gloo group."""

from __future__ import annotations

from tests.compat.ds_fixture_model import (
    SAVE_STEP,
    TOTAL_STEPS,
    ds_config,
    param_groups,
    tiny_model,
    train_steps,
)


def resume_worker(imported: dict[int, str], stages: dict[int, int]) -> dict[int, list[float]]:
    """For each DeepSpeed stage: a fresh engine (other weights) at our ZeRO stage ``stages[ds_stage]``,
    ``load_checkpoint(imported dir)``, then DeepSpeed's next steps; the global batch's mean loss per step."""
    import deepshard.compat.deepspeed as deepspeed

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    out = {}
    for ds_stage, path in imported.items():
        model = tiny_model(seed=1)
        cfg = ds_config(stages[ds_stage], world)
        # the groups DeepSpeed trained with (ds_fixture_model.param_groups): vectors undecayed
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
        loaded, _ = engine.load_checkpoint(path)
        assert loaded is not None and engine.global_steps == SAVE_STEP
        out[ds_stage] = train_steps(engine, range(SAVE_STEP, TOTAL_STEPS), rank, world)
    return out
