"""An ordinary checkpoint written by one process with no training behind it (a converter bringing in
another tool's files), each tensor built only when DCP writes it, so the peak memory is about one
tensor, never the model.

The result is what :func:`~deepshard.core.checkpoint.state.load_checkpoint` reads like any save:
DCP shards, ``trainer.json``, the manifest with every file's crc32.  It is written into
``step-N.tmp-import``, marked with its writer's host and pid from the moment it exists, and renamed
into place whole: a leftover of a killed writer is removed, a live writer's is named, never touched.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from deepshard.core.checkpoint.json_state import TRAINER, write_json
from deepshard.core.checkpoint.manifest import (
    FORMAT,
    describe_files,
    list_files,
    step_dir_name,
    write_manifest,
)
from deepshard.core.checkpoint.owners import OWNER, owner_alive, write_owner

__all__ = ["claim_temp_dir", "write_offline_checkpoint"]


class _StreamingPlanner(DefaultSavePlanner):
    """DCP planner over meta placeholders: each tensor is built only when the writer asks for it."""

    def __init__(self, build: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self._build = build

    def resolve_data(self, write_item: Any) -> torch.Tensor:
        return self._build(write_item.index.fqn)


def write_offline_checkpoint(
    root: str | os.PathLike,
    step: int,
    shapes: dict[str, torch.Tensor],
    build: Callable[[str], torch.Tensor],
    *,
    scaler: dict[str, Any],
    app_state: dict[str, Any],
    zero_stage: int,
    dp_size: int,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write ``root/step-NNNNNNNN`` from one process; returns its path.

    ``shapes``: every key (``model.<name>``, ``optim.exp_avg.<name>``, ``optim.exp_avg_sq.<name>``) as a
    meta tensor of its shape and dtype; ``build(key)`` returns the full tensor when DCP writes it (a
    ValueError or OSError it raises comes out as itself, the partial checkpoint removed).  ``step`` is
    the update count (the LR schedule's position); ``scaler`` the loss scaler's state; ``app_state``
    what load_checkpoint hands back; ``zero_stage`` / ``dp_size`` the layout it came from.  No RNG
    state is written, so every rank that loads it keeps its own."""
    final = Path(root) / step_dir_name(step)
    tmp = Path(root) / f"{final.name}.tmp-import"
    if os.path.lexists(final):  # before any work: a checkpoint that cannot be renamed into place is wasted
        raise ValueError(f"{final}: already exists; choose an empty output directory")
    claim_temp_dir(tmp)
    try:
        _write(tmp, step, shapes, build, scaler=scaler, app_state=app_state, zero_stage=zero_stage, dp_size=dp_size,
               meta=meta or {})
        (tmp / OWNER).unlink()
    except BaseException:  # a refused or short input, a full disk, Ctrl-C: no half-written checkpoint stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tmp.rename(final)  # atomic: the output holds the whole checkpoint or none of it
    return final


def _write(tmp: Path, step: int, shapes: dict[str, torch.Tensor], build: Callable[[str], torch.Tensor], *,
           scaler: dict[str, Any], app_state: dict[str, Any], zero_stage: int, dp_size: int,
           meta: dict[str, Any]) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
        try:
            dcp.save(shapes, storage_writer=FileSystemWriter(str(tmp), thread_count=1),
                     planner=_StreamingPlanner(build), no_dist=True)
        except CheckpointException as err:  # DCP wraps what failed (an input refused or short, a full disk):
            first = next(iter(err.failures.values()))[0]  # that is what the user needs to read
            if isinstance(first, (ValueError, OSError)):
                raise first from None
            raise
    # world_size 0 matches no loading world: RNG states are never restored from it
    write_json(tmp, TRAINER, {"num_updates": step, "scaler": scaler, "app": app_state, "world_size": 0,
                              "zero_stage": zero_stage})
    write_manifest(tmp, {
        "format": FORMAT, "step": step, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "world": {"world_size": 0, "dp_size": dp_size, "zero_stage": zero_stage},
        "num_params": sum(1 for k in shapes if k.startswith("optim.exp_avg.")), "meta": meta,
        "checksum": "crc32", "files": describe_files(tmp, list_files(tmp)),
    })


def claim_temp_dir(tmp: Path) -> None:
    """Make ``tmp`` this writer's, marked with its owner (host, pid) from the moment it exists (made
    aside and renamed into place).  A leftover of a dead writer (a kill leaves no chance to clean up) is
    removed with a notice; one whose writer still runs is named, never touched: two writers into one
    directory would write the same files.  Anything else at ``tmp`` (a symlink, dangling or not; a file)
    is named and left alone."""
    for _ in range(3):
        if tmp.is_symlink() or (tmp.exists() and not tmp.is_dir()):  # not a writer's: never followed, removed
            kind = "a symlink" if tmp.is_symlink() else "not a directory"
            raise ValueError(f"{tmp}: is {kind}, not an import's temp dir; it was left alone (move or remove it, "
                             "then run again)")
        if tmp.exists():
            alive, who = owner_alive(tmp)
            if alive:
                raise ValueError(f"{tmp}: another import is writing it ({who}, still running); wait for it "
                                 f"to finish or stop it, then run again")
            print(f"notice: removing the partial import {tmp} (its importer, {who}, is not running)", file=sys.stderr)
            shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        aside = tmp.parent / f".{tmp.name}.{os.getpid()}"
        aside.mkdir()
        try:
            write_owner(aside)
        except BaseException:  # a full disk: nothing of this import stays
            shutil.rmtree(aside, ignore_errors=True)
            raise
        try:
            os.rename(aside, tmp)  # fails if another writer made tmp meanwhile: look at its owner again
            return
        except OSError:
            shutil.rmtree(aside, ignore_errors=True)
    raise ValueError(f"{tmp}: another import keeps creating it; run one import into {tmp.parent} at a time")
