"""Sharded, atomic checkpoints of a ZeRO run through torch.distributed.checkpoint (DCP).

Every tensor is saved as a DTensor over the dp mesh with its true placement: the fp32 master
weights (under ``model.<fqn>``) and AdamW moments (``optim.exp_avg.<fqn>``, ...) are Shard(0) at
stages 1-3 and Replicate at stage 0.  DCP records each chunk's global offset, so a checkpoint
loads at any world size and any stage.  Keys are stage-agnostic (wrapper prefixes such as
``_checkpoint_wrapped_module.`` are dropped).  Saving the fp32 master, not the compute-dtype
param, lets a bf16 run resume in fp32 and the reverse.

Scalars (update count, loss scaler, the caller's ``app_state``) travel in DCP as one pickled
object; each rank's RNG state under its own key.  The optimizer state goes through the
StateStore's ``state_dict``/``load_state_dict`` only, so offloaded stores work unchanged.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from deepshard.core.checkpoint_manifest import (
    FORMAT,
    CheckpointError,
    describe_files,
    latest_good,
    list_files,
    prune,
    publish,
    read_manifest,
    step_dir_name,
    verify_files,
    write_manifest,
)
from deepshard.core.optim import ZeroOptimizer
from deepshard.core.dtensor_utils import local_tensor

__all__ = ["CheckpointError", "clean_name", "latest_good", "load_checkpoint", "prune", "save_checkpoint",
           "step_dir_name", "training_state"]

log = logging.getLogger("deepshard.checkpoint")

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
KINDS = (("master", "model."), ("exp_avg", "optim.exp_avg."), ("exp_avg_sq", "optim.exp_avg_sq."))
SCALARS = "trainer"


def clean_name(name: str) -> str:
    """A parameter's FQN without wrapper modules, so keys do not depend on AC, compile or stage."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def unsupported_reason(optimizer: ZeroOptimizer) -> str | None:
    """Why this layout cannot be checkpointed yet (None when it can): tensor-parallel params at
    stages 1-2 would need a strided dp-over-tp placement that is not built here."""
    stage = optimizer.stage
    if 0 < stage.stage < 3 and any(isinstance(p, DTensor) for p in stage.params):
        return "tensor-parallel parameters at zero stages 1-2 (use zero.stage=0 or 3 with parallel.tp > 1)"
    return None


def _as_dtensor(local: torch.Tensor, param: torch.Tensor, stage: int, dp_mesh: DeviceMesh) -> DTensor:
    """``local`` (this rank's state for ``param``) as a DTensor with the layout the stage gives it."""
    if isinstance(param, DTensor):
        if 0 < stage < 3:
            raise NotImplementedError("checkpointing tensor-parallel params at zero stages 1-2: see unsupported_reason")
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    placement = Replicate() if stage == 0 or param.dim() == 0 else Shard(0)
    return DTensor.from_local(local, dp_mesh, [placement], run_check=False, shape=param.shape,
                              stride=param.stride())


def training_state(optimizer: ZeroOptimizer, dp_mesh: DeviceMesh,
                   model: nn.Module | None = None) -> tuple[dict[str, Any], dict[str, list[torch.Tensor]]]:
    """The DCP state dict (DTensor views of the store's tensors) and the store's own lists.

    Params outside the optimizer (frozen weights, persistent buffers) of ``model`` are added as
    they are, so a partly frozen model still round-trips.
    """
    stage = optimizer.stage
    store_state = optimizer.store.state_dict()
    out: dict[str, Any] = {}
    for i, (name, p) in enumerate(zip(stage.names, stage.params)):
        key = clean_name(name)
        for kind, prefix in KINDS:
            out[prefix + key] = _as_dtensor(store_state[kind][i], p, stage.stage, dp_mesh)
    if model is not None:
        trained = {clean_name(n) for n in stage.names}
        for name, t in model.state_dict().items():
            if clean_name(name) not in trained:
                out["model." + clean_name(name)] = t
    return out, store_state


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _agree(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    optimizer: ZeroOptimizer,
    dp_mesh: DeviceMesh,
    *,
    model: nn.Module | None = None,
    app_state: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    write_extra: Any = None,
) -> Path:
    """Write ``root/step-NNNNNNNN`` atomically from every rank; returns its path.

    ``app_state`` (picklable: data position, tokens seen...) comes back from :func:`load_checkpoint`;
    ``meta`` (JSON: config, model architecture) goes into the manifest for tools such as export;
    ``write_extra(tmp_dir)`` runs on rank 0 to add files (a tokenizer) before the manifest seals them.
    """
    rank, world = _world()
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}.tmp-{_agree(uuid.uuid4().hex[:8])}"
    start = time.perf_counter()
    state, _ = training_state(optimizer, dp_mesh, model)
    # pickled, so DCP stores each as one opaque item instead of flattening nested dicts
    state[SCALARS] = pickle.dumps({"num_updates": optimizer.num_updates, "scaler": optimizer.scaler.state_dict(),
                                   "app": app_state or {}, "world_size": world, "zero_stage": optimizer.stage.stage})
    state[f"rng.{rank}"] = pickle.dumps(rng_state())
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(state, checkpoint_id=str(tmp))
    if rank == 0 and write_extra is not None:
        write_extra(tmp)
    if dist.is_initialized():
        dist.barrier()
    # every rank checksums a share of the files, so sealing costs 1/world of a read
    names = _agree(list_files(tmp))
    mine = describe_files(tmp, names[rank::world])
    parts = [mine]
    if dist.is_initialized():
        parts = [None] * world
        dist.all_gather_object(parts, mine)
    if rank == 0:
        files: dict[str, Any] = {}
        for p in parts:
            files.update(p)
        write_manifest(tmp, {
            "format": FORMAT, "step": step, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "world": {"world_size": world, "dp_size": dp_mesh.size(), "zero_stage": optimizer.stage.stage},
            "num_params": len(optimizer.stage.names), "meta": meta or {}, "checksum": "crc32", "files": files,
        })
        publish(tmp, final)
    if dist.is_initialized():
        dist.barrier()
    total = sum(f["bytes"] for p in parts for f in p.values())
    log.info("checkpoint: saved %s (%.1f MB) in %.2fs", final, total / 1e6, time.perf_counter() - start)
    return final


def verify_collective(path: str | os.PathLike) -> dict[str, Any]:
    """Every rank checks a share of the files; the same CheckpointError is raised on all ranks."""
    rank, world = _world()
    try:
        manifest = read_manifest(path)
        problems = verify_files(path, manifest, part=(rank, world))
    except CheckpointError as err:
        manifest, problems = None, [str(err)]
    everyone = [problems]
    if dist.is_initialized():
        everyone = [None] * world
        dist.all_gather_object(everyone, problems)
    problems = [p for ps in everyone for p in ps]
    if problems:
        if manifest is None:
            raise CheckpointError(problems[0])
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: " + "; ".join(problems))
    return manifest


def load_checkpoint(
    path: str | os.PathLike,
    optimizer: ZeroOptimizer,
    dp_mesh: DeviceMesh,
    *,
    model: nn.Module | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Restore weights, optimizer state, update count, loss scaler and RNG from ``path``.

    Works at any world size and stage.  RNG states come back only when the world size matches
    (otherwise each rank keeps its own).  Returns the ``app_state`` given to the save.
    """
    rank, world = _world()
    start = time.perf_counter()
    manifest = verify_collective(path) if verify else read_manifest(path)
    state, store_state = training_state(optimizer, dp_mesh, model)
    state[SCALARS] = b""
    saved_world = manifest["world"]["world_size"]
    if saved_world == world:
        state[f"rng.{rank}"] = b""
    try:
        dcp.load(state, checkpoint_id=str(path))
    except Exception as err:  # DCP wraps per-rank failures; name the checkpoint and the cause
        raise CheckpointError(f"checkpoint {str(path)!r}: loading failed ({type(err).__name__}: {err})") from err
    loaded = {kind: [] for kind, _ in KINDS}
    stage = optimizer.stage
    for name in stage.names:
        for kind, prefix in KINDS:
            loaded[kind].append(local_tensor(state[prefix + clean_name(name)]))
    optimizer.store.load_state_dict(loaded)
    stage.after_step()  # stages 1-2: all-gather the restored shards into the replicated params
    scalars = pickle.loads(state[SCALARS])
    optimizer.num_updates = int(scalars["num_updates"])
    optimizer.scaler.load_state_dict(scalars["scaler"])
    if saved_world == world:
        set_rng_state(pickle.loads(state[f"rng.{rank}"]))
    log.info("checkpoint: loaded %s (saved at world %d, stage %d; now world %d, stage %d) in %.2fs", path,
             saved_world, manifest["world"]["zero_stage"], world, stage.stage, time.perf_counter() - start)
    del store_state
    return dict(scalars["app"])


def find_resume(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint under ``root`` that verifies (rank 0 decides), logging what it skipped."""
    rank, _ = _world()
    found: Path | None = None
    if rank == 0:
        found, skipped = latest_good(root)
        for reason in skipped:
            log.warning("checkpoint: skipping %s", reason)
        if found is not None and skipped:
            log.warning("checkpoint: resuming from the newest good one, %s", found)
    return _agree(found)
