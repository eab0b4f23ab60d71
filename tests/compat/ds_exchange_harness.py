"""Issue 34 item 4: checkpoint exchange with DeepSpeed on ordinary scripts, per rank of a gloo group."""

from __future__ import annotations

from ds_fixture_model import SAVE_STEP, TOTAL_STEPS, ds_config, tiny_model, train_steps


def resume_tied_worker(imported: str, stage: int) -> dict:
    """A fresh tied-embedding engine (other weights) at our ZeRO ``stage`` resumes the import of
    DeepSpeed's checkpoint and trains DeepSpeed's next steps."""
    import deepshard.compat.deepspeed as deepspeed

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    model = tiny_model(seed=1, tied=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(stage, world))
    path, client_state = engine.load_checkpoint(imported)
    assert path is not None and engine.global_steps == SAVE_STEP
    step = client_state["step"]  # what the script reads back (DeepSpeedExamples' scripts: the epoch/step)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return {"client_state": client_state, "step": step, "tied": tied,
            "losses": train_steps(engine, range(SAVE_STEP, TOTAL_STEPS), rank, world)}
