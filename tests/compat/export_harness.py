"""DeepSpeed resumes checkpoints written by us (exported with to_deepspeed), on one rank of a gloo group."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tests.compat.ds_fixture_model import (
    SAVE_STEP,
    TOTAL_STEPS,
    ds_config,
    param_groups,
    tiny_model,
    train_steps,
)


def export_worker(root: str, imported: str, stage: int) -> dict[str, list[float]]:
    """Ours trains 3 steps, saves, trains 3 more; DeepSpeed resumes the exported save and the exported
    import of its own fixture checkpoint, 3 steps each."""
    import deepshard.compat.deepspeed as ours
    from deepshard.compat.deepspeed.ds_export import export_checkpoint

    ours.init_distributed()
    rank, world = ours.comm.get_rank(), ours.comm.get_world_size()
    model = tiny_model()
    # DeepSpeed's two groups (below): the ds_config's weight_decay on the matrices, none on the vectors
    engine, *_ = ours.initialize(model=model, model_parameters=param_groups(model), config=ds_config(stage, world))
    train_steps(engine, range(SAVE_STEP), rank, world)
    engine.save_checkpoint(f"{root}/ours")
    ours_after = train_steps(engine, range(SAVE_STEP, TOTAL_STEPS), rank, world)
    if rank == 0:
        export_checkpoint(f"{root}/ours/global_step{SAVE_STEP}", f"{root}/ds_from_ours", stage=stage, world=world)
        export_checkpoint(imported, f"{root}/ds_from_import", stage=stage, world=world)
    torch.distributed.barrier()

    sys.stdout.flush()
    os.dup2(2, 1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    out = {"ours": ours_after}
    for name in ("ds_from_ours", "ds_from_import"):
        m = tiny_model(seed=1)
        ds, *_ = deepspeed.initialize(model=m, model_parameters=param_groups(m), config=ds_config(stage, world))
        path, _ = ds.load_checkpoint(str(Path(root) / name))
        assert path is not None and ds.global_steps == SAVE_STEP
        out[name] = train_steps(ds, range(SAVE_STEP, TOTAL_STEPS), rank, world)
    return out
