"""Sharded, atomic checkpoints of a ZeRO run through torch.distributed.checkpoint (DCP): the
collective save, load and resume search.

What a checkpoint holds (DTensors with their true placements, so it loads at any world size and
stage) and what one save captures are ``request``'s; here a :class:`SaveRequest` is written: shards,
JSON scalars and RNG states (json_state), a crc32 of every file, the manifest, the atomic publish.
Saving the fp32 master, not the compute-dtype param, lets a bf16 run resume in fp32 and the reverse.
Loading runs nothing from the checkpoint (safe_load).  A save checks free space first, and on any
failure removes its temp dir on every path out.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh

from deepshard.core.checkpoint.failures import (
    MARGIN_BYTES,
    CheckpointSaveError,
    PhaseFailed,
    agree,
    clean_up,
    free_space_check,
    gather,
    one_line,
    phase,
    rank_and_world,
    root_cause,
    save_planner,
    slow_write_seconds,
    stall,
)
from deepshard.core.checkpoint.json_state import (
    TRAINER,
    read_json,
    read_trainer,
    rng_file,
    set_rng_state,
    write_json,
)
from deepshard.core.checkpoint.manifest import (
    FORMAT,
    CheckpointError,
    describe_files,
    in_the_way,
    latest_good,
    list_files,
    publish,
    read_manifest,
    step_dir_name,
    verify_files,
    write_manifest,
)
from deepshard.core.checkpoint.owners import OWNER, write_owner
from deepshard.core.checkpoint.progress import ProgressWriter
from deepshard.core.checkpoint.request import (
    SaveRequest,
    checkpoint_bytes,
    clean_name,
    held,
    mesh_on,
    save_request,
    state_kinds,
    tied_aliases,
    training_state,
    unsupported_reason,
)
from deepshard.core.checkpoint.retention import prune, remove_dead_temp_dirs
from deepshard.core.checkpoint.safe_load import SafeLoadPlanner, SafeReader, read_metadata_safely
from deepshard.core.dtensor_utils import local_tensor
from deepshard.core.optim import ZeroOptimizer

__all__ = ["CheckpointError", "CheckpointSaveError", "SaveRequest", "checkpoint_bytes", "clean_name", "find_resume",
           "latest_good", "load_checkpoint", "mesh_on", "prune", "save_checkpoint", "save_request", "step_dir_name",
           "training_state", "unsupported_reason", "verify_collective", "write_checkpoint"]

log = logging.getLogger("deepshard.checkpoint")

def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    optimizer: ZeroOptimizer,
    dp_mesh: DeviceMesh,
    *,
    model: nn.Module | None = None,
    app_state: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``root/step-NNNNNNNN`` atomically from every rank; returns its path.

    ``app_state`` (JSON: data position, tokens seen...) comes back from :func:`load_checkpoint`;
    ``meta`` (JSON: config, model architecture) goes into the manifest for tools such as export;
    ``write_extra(tmp_dir)`` runs on rank 0 to add files (a tokenizer) before the manifest seals them.
    Raises CheckpointSaveError on every rank when the save fails anywhere (not enough free space,
    an I/O error): the partial temp dir is removed and nothing older is touched.
    """
    request = save_request(root, step, optimizer, dp_mesh, model=model, app_state=app_state, meta=meta,
                           write_extra=write_extra)
    return write_checkpoint(request)


def write_checkpoint(request: SaveRequest, group: dist.ProcessGroup | None = None) -> Path:
    """Write ``request`` atomically from every rank of ``group`` (the default group, or the writer
    thread's own gloo group of an asynchronous save): shards, JSON, checksums, manifest, publish.
    CheckpointSaveError on every rank when it fails anywhere, its temp dir removed."""
    rank, world = rank_and_world(group)
    root, step, state = request.root, request.step, request.state
    final = root / step_dir_name(step)
    tmp = root / f"{final.name}.tmp-{agree(uuid.uuid4().hex[:8], group)}"
    start = time.perf_counter()
    needed = checkpoint_bytes(state) + MARGIN_BYTES

    made: list[Path] = []  # rank 0: the temp dirs this save created, the only ones a failure removes

    def begin() -> None:
        if rank == 0:
            free_space_check(root, needed)
            staging = root / f"{final.name}.init-{tmp.name.rsplit('-', 1)[-1]}"
            staging.mkdir()
            made.append(staging)
            write_owner(staging)  # before the dir gets its .tmp- name, so no one takes it for dead
            if tmp.exists() or tmp.is_symlink():
                raise in_the_way(tmp, "the name of this save's temp dir")
            os.replace(staging, tmp)
            made[-1] = tmp

    def extra() -> None:
        stall(step)
        write_json(tmp, rng_file(rank), request.rng)
        if rank == 0:
            write_json(tmp, TRAINER, request.trainer)
            if request.write_extra is not None:
                request.write_extra(tmp)

    def seal(parts: list[dict[str, Any]]) -> None:
        if rank == 0:
            files: dict[str, Any] = {}
            for p in parts:
                files.update(p)
            write_manifest(tmp, {
                "format": FORMAT, "step": step, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "world": request.world, "num_params": request.num_params, "meta": request.meta or {},
                "checksum": "crc32", "files": files,
            })
            publish(tmp, final)
            (final / OWNER).unlink(missing_ok=True)

    try:
        phase(begin, group)
        # every byte written is reported (progress.report): a slow save is not a hung one to a watchdog
        phase(lambda: dcp.save(state, storage_writer=ProgressWriter(tmp, pace=slow_write_seconds(step)),
                               process_group=group, planner=save_planner(step)), group)
        phase(extra, group)
        # every rank checksums a share of the files, so sealing costs 1/world of a read
        names = agree(list_files(tmp), group)
        parts = gather(phase(lambda: describe_files(tmp, names[rank::world]), group), group)
        phase(lambda: seal(parts), group)
    except PhaseFailed as err:
        reason = str(err)
        if rank == 0:
            reason = clean_up(root, made, reason, needed)
        raise CheckpointSaveError(root, step, agree(reason, group)) from None
    total = sum(f["bytes"] for p in parts for f in p.values())
    log.info("checkpoint: saved %s (%.1f MB) in %.2fs", final, total / 1e6, time.perf_counter() - start)
    return final


def _collective_problems(check: Callable[[], list[str]]) -> list[str]:
    """Every rank's problems from ``check`` (CheckpointError counts as one), the same list on all ranks."""
    try:
        problems = check()
    except CheckpointError as err:
        problems = [str(err)]
    return [p for ps in gather(problems) for p in ps]


def verify_collective(path: str | os.PathLike) -> dict[str, Any]:
    """Every rank checks a share of the files; the same CheckpointError is raised on all ranks."""
    rank, world = rank_and_world()
    box: list[dict[str, Any]] = []

    def check() -> list[str]:
        box.append(read_manifest(path))
        return verify_files(path, box[0], part=(rank, world))

    problems = _collective_problems(check)
    if problems:
        if not box or problems[0].startswith(f"checkpoint {str(path)!r}:"):
            raise CheckpointError(problems[0])
        raise CheckpointError(f"checkpoint {str(path)!r} is damaged: " + "; ".join(problems))
    return box[0]


def load_checkpoint(
    path: str | os.PathLike,
    optimizer: ZeroOptimizer,
    dp_mesh: DeviceMesh,
    *,
    model: nn.Module | None = None,
    verify: bool = True,
    rename: Callable[[str], str] | None = None,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore weights, optimizer state, update count, loss scaler and RNG from ``path``.

    ``rename``: the checkpoint's key for each of ours (``model.<name>``, ``optim.exp_avg.<name>``...),
    for a checkpoint written under other parameter names (one imported from DeepSpeed has HF names).

    Works at any world size and stage (global shapes are what must match).  A checkpoint of another
    model (a key more or less, a shape differing) is refused before anything is loaded, naming the
    first mismatch; given this run's ``meta`` (as a save would record it), the differing fields of
    ``meta["model"]`` are named too.  RNG states come back only when the world size matches
    (otherwise each rank keeps its own).  Returns the ``app_state`` given to the save.  Nothing in
    the checkpoint is executed, and only files its manifest lists are read: a crafted one is refused
    by name (CheckpointError on every rank).
    """
    rank, world = rank_and_world()
    start = time.perf_counter()
    manifest = verify_collective(path) if verify else read_manifest(path)
    box: list[Any] = []

    def check_metadata() -> list[str]:
        # before DCP reads it: a crafted .metadata, or one naming files the manifest does not cover, is
        # refused on every rank
        box.append(read_metadata_safely(path, manifest=manifest))
        return []

    problems = _collective_problems(check_metadata)
    if problems:
        raise CheckpointError(problems[0])
    metadata = box[0]
    trainer = read_trainer(path, manifest)
    saved_world = manifest["world"]["world_size"]
    rng = read_json(path, rng_file(rank), manifest) if saved_world == world else None
    stage = optimizer.stage
    stage.gather_params()  # zero.overlap_allgather: a gather still in flight lands before DCP writes the shards
    state = training_state(optimizer, dp_mesh, model)
    saved_keys = {k: rename(k) if rename is not None else k for k in state}
    loading = {saved_keys[k]: v for k, v in state.items()}
    problem, unloaded = model_mismatch_of_rank(path, metadata, loading)
    if model is not None:  # a tied head saved twice by earlier versions: its second copy is not read
        aliases = {f"model.{a}" for a in tied_aliases(model, {clean_name(n) for n in stage.names})}
        unloaded = [k for k in unloaded if k not in aliases]
    mismatch = model_mismatch(path, (problem, unloaded))
    if mismatch:
        raise CheckpointError(mismatch + architecture_diff(manifest, meta))
    try:
        dcp.load(loading, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
        state = {k: loading[saved_keys[k]] for k in state}
    except (Exception, CheckpointException) as err:  # DCP wraps per-rank failures; name the checkpoint and cause
        cause = root_cause(err)
        if isinstance(cause, CheckpointError):  # SafeReader's, naming the file
            raise CheckpointError(str(cause)) from None
        raise CheckpointError(f"checkpoint {str(path)!r}: loading failed ({one_line(err)})") from None
    kinds = state_kinds(optimizer)
    loaded = {kind: [] for kind, _ in kinds}
    for i, name in enumerate(stage.names):
        for kind, prefix in kinds:
            loaded[kind].append(local_tensor(state[prefix + clean_name(name)]) if held(optimizer, kind, i) else None)
    optimizer.store.load_state_dict(loaded)
    stage.after_step()  # stages 1-2: all-gather the restored shards into the replicated params
    optimizer.num_updates = int(trainer["num_updates"])
    optimizer.scaler.load_state_dict(trainer["scaler"])
    if rng is not None:
        set_rng_state(rng)
    log.info("checkpoint: loaded %s (saved at world %d, stage %d; now world %d, stage %d) in %.2fs", path,
             saved_world, manifest["world"]["zero_stage"], world, stage.zero_stage, time.perf_counter() - start)
    return dict(trainer["app"])


def model_mismatch_of_rank(path: str | os.PathLike, metadata: Metadata,
                           loading: dict[str, Any]) -> tuple[str | None, list[str]]:
    """This rank's first difference between the tensors it loads and the checkpoint's (keys as saved,
    global shapes), and the checkpoint's keys it does not load (model weights first)."""
    saved = metadata.state_dict_metadata
    for key, value in loading.items():
        md = saved.get(key)
        if md is None:
            return f"checkpoint {str(path)!r} lacks {key}, which this run's model has", []
        if not isinstance(md, TensorStorageMetadata):
            return f"checkpoint {str(path)!r}: {key} is not a tensor there", []
        if tuple(md.size) != tuple(value.shape):
            return (f"checkpoint {str(path)!r}: {key} has shape {list(md.size)} there, {list(value.shape)} in "
                    f"this run"), []
    return None, sorted((k for k in saved if k not in loading), key=lambda k: not k.startswith("model."))


def model_mismatch(path: str | os.PathLike, mine: tuple[str | None, list[str]]) -> str | None:
    """The first mismatch over all ranks (the same on each): a key some rank lacks or a shape, else a
    key of the checkpoint that no rank loads (with pipeline stages, each rank loads only its own)."""
    found = gather(mine)
    problem = next((p for p, _ in found if p), None)
    if problem is None:
        unloaded = set.intersection(*(set(extra) for _, extra in found))
        first = next((k for k in found[0][1] if k in unloaded), None)
        if first is not None:
            problem = f"checkpoint {str(path)!r} holds {first}, which this run's model does not have"
    return problem


def architecture_diff(manifest: dict[str, Any], meta: dict[str, Any] | None) -> str:
    """`` (the checkpoint's model differs: n_layers 3 vs 2)``: the fields of ``meta["model"]`` that differ
    between the checkpoint's manifest and this run's ``meta`` (empty when either is absent)."""
    theirs, ours = manifest.get("meta", {}).get("model"), (meta or {}).get("model")
    if not (isinstance(theirs, dict) and isinstance(ours, dict)):
        return ""
    ours = json.loads(json.dumps(ours, default=str))  # as the manifest holds it: a tuple is a list there
    fields = [f"{k} {theirs.get(k)} vs {ours.get(k)}" for k in sorted(set(theirs) | set(ours))
              if theirs.get(k) != ours.get(k)]
    return f" (the checkpoint's model differs: {', '.join(fields[:4])})" if fields else ""


def find_resume(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint under ``root`` that verifies (rank 0 decides), logging what it skipped.

    Unfinished saves (temp dirs) are never candidates: those of dead runs are removed, a live
    concurrent save is left alone; each is logged.
    """
    rank, _ = rank_and_world()
    found: Path | None = None
    if rank == 0:
        for line in remove_dead_temp_dirs(root):
            log.warning("checkpoint: %s", line)
        found, skipped = latest_good(root)
        for reason in skipped:
            log.warning("checkpoint: skipping %s", reason)
        if found is not None and skipped:
            log.warning("checkpoint: resuming from the newest good one, %s", found)
    return agree(found)
