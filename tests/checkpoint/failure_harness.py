"""World-2 workers for the save-failure and shared-directory tests (one launch serves them all)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist

from deepshard.core.checkpoint.manifest import CheckpointError, step_dirs, verify_checkpoint
from deepshard.core.checkpoint.retention import temp_dirs
from tests.checkpoint.ckpt_harness import make_engine, run_steps, save


def _outcome(fn) -> str | None:
    try:
        fn()
    except ValueError as err:  # CheckpointError is a ValueError too
        return str(err)
    return None


def _state(root: Path) -> dict:
    return {"steps": [c.step for c in step_dirs(root)], "temp": [p.name for p, _, _ in temp_dirs(root)]}


def disk_worker(scratch: str, small: str) -> dict:
    """Run-dir agreement and the visibility probe; then saves into ``small`` (a tiny tmpfs): one that
    fits, one refused up front for lack of space, one that hits a real ENOSPC mid-write."""
    from deepshard.core import init_distributed
    from deepshard.core.checkpoint import state as checkpoint
    from deepshard.finetune.recipe.checkpointing import agree_run_dir, check_shared_dir

    init_distributed()
    rank = dist.get_rank()
    scratch_p, small_p = Path(scratch), Path(small)
    out: dict = {"run_dir": agree_run_dir(str(scratch_p / f"hydra-dir-of-rank{rank}"))}
    out["shared"] = _outcome(lambda: check_shared_dir(scratch_p / "shared"))
    # what a node-local disk looks like: the same setting names a different directory on each node
    out["node_local"] = _outcome(lambda: check_shared_dir(scratch_p / f"local-disk-of-rank{rank}"))

    engine = make_engine(2)
    run_steps(engine, range(1))
    first = save(engine, small_p, 1)
    if rank == 0:  # fill the disk, leaving less than a checkpoint
        free = shutil.disk_usage(small_p).free
        with open(small_p / "filler", "wb") as f:
            f.write(b"\0" * max(free - 200_000, 0))
    dist.barrier()
    out["no_space"] = _outcome(lambda: save(engine, small_p, 2))
    out["after_no_space"] = _state(small_p)
    checkpoint.free_space_check = lambda *a: None  # the disk fills up after the check (another writer)
    out["enospc"] = _outcome(lambda: save(engine, small_p, 3))
    out["after_enospc"] = _state(small_p)
    try:
        verify_checkpoint(first)
        out["first_intact"] = True
    except CheckpointError as err:
        out["first_intact"] = str(err)
    if rank == 0:
        os.remove(small_p / "filler")
    return out
