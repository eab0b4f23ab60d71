"""How a checkpoint save fails: agreed by every rank, in one line, with the free space checked first.

Each phase of a save ends in one small all-gather of "did it fail here, and why", so a failure on
one rank (a full disk, an I/O error, a rank-0-only step) reaches every rank instead of leaving the
others waiting; the caller then removes the temp dir and raises one CheckpointSaveError.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from deepshard.core.checkpoint.manifest import CheckpointError
from deepshard.core.checkpoint.planner import ModuleOrderPlanner

log = logging.getLogger("deepshard.checkpoint")

STALL_ENV = "DEEPSHARD_FAULT_SAVE_STALL"  # fault injection "STEP:SECONDS[:WHERE],...": see _stall_seconds
MARGIN_BYTES = 1 << 20  # manifest, JSON state, DCP metadata


class CheckpointSaveError(CheckpointError):
    """A save that failed (no space, I/O error): its temp dir is gone; ``reason`` is one line."""

    def __init__(self, root: Path, step: int, reason: str) -> None:
        super().__init__(f"checkpoint {str(root)!r}: saving step {step} failed: {reason}")
        self.root, self.step, self.reason = root, step, reason


def gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value`` (of ``group``: the default one, or an asynchronous writer's own)."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def rank_and_world(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without a process group."""
    return (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)


def agree(value: Any, group: dist.ProcessGroup | None = None) -> Any:
    """Rank 0's ``value`` on every rank (of ``group``, which holds global rank 0)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def root_cause(err: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (``err`` itself otherwise)."""
    while isinstance(err, CheckpointException) and err.failures:
        wrapped = next(iter(err.failures.values()))
        err = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    return err


def one_line(err: BaseException) -> str:
    """The cause of a failure in one line (DCP's CheckpointException carries each rank's traceback)."""
    if isinstance(err, CheckpointException) and err.failures:
        rank, wrapped = next(iter(err.failures.items()))
        exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        return f"rank {rank}: {one_line(exc)}"
    if isinstance(err, CheckpointError):
        return str(err)
    text = str(err).strip()
    if text.startswith(_TORCH_REFUSAL):  # torch.load(weights_only=True) refused: its cause, not its advice
        causes = [line.strip() for line in text.splitlines()[1:] if line.strip()
                  and not line.strip().startswith(("Please file an issue", "Check the documentation"))]
        return f"{type(err).__name__}: not plain tensor data: {causes[0] if causes else 'refused by the safe loader'}"
    lines = text.splitlines()
    line = f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    if "weights_only" in line and "False" in line:  # never pass on advice to load a refused file unsafely
        return f"{type(err).__name__}: refused by torch's safe loader"
    return line


_TORCH_REFUSAL = "Weights only load failed"  # its first line advises weights_only=False, which would run the file


def _is_enospc(err: BaseException | None) -> bool:
    seen = 0
    while err is not None and seen < 20:
        if isinstance(err, OSError) and err.errno == errno.ENOSPC:
            return True
        if isinstance(err, CheckpointException):
            return any(_is_enospc(w[0] if isinstance(w, tuple) else w) for w in err.failures.values())
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def phase(fn: Callable[[], Any], group: dist.ProcessGroup | None = None) -> Any:
    """Run one phase of a save on every rank; if it failed anywhere, every rank raises the first cause.

    Agreeing after each phase means a rank-0-only step that fails cannot leave the others waiting.
    """
    result, failure = None, None
    try:
        result = fn()
    except (Exception, CheckpointException) as err:
        failure = ("ENOSPC " if _is_enospc(err) else "") + one_line(err)
    failures = [f for f in gather(failure, group) if f]
    if failures:
        raise PhaseFailed(failures[0])
    return result


class PhaseFailed(Exception):
    pass


def _stall_seconds(step: int, where: str, *, now: bool = True) -> float | None:
    """``DEEPSHARD_FAULT_SAVE_STALL=STEP:SECONDS[:WHERE][,STEP:SECONDS[:WHERE]...]``: the pause asked for the
    save of ``step`` at ``where``.  ``sealing`` (the default) and ``shard`` model a hung writer: it sleeps
    writing nothing, with the shards written and the manifest not (``sealing``) or inside a shard file
    (``shard``).  ``slow`` models a slow writer that still writes: the first write of the shard file
    trickles out over SECONDS, each piece reported as progress (``progress``).  ``now``: the pause
    starts now, and the log says so (the tests signal on that line)."""
    for spec in filter(None, os.environ.get(STALL_ENV, "").split(",")):
        parts = spec.split(":")
        if int(parts[0]) == step and (parts[2] if len(parts) > 2 else "sealing") == where:
            if now:
                _say_paused(spec, where)
            return float(parts[1])
    return None


def _say_paused(spec: str, where: str) -> None:
    log.warning("checkpoint: %s=%s: pausing this save for a fault-injection test (%s)", STALL_ENV, spec, where)


def stall(step: int) -> None:
    """Fault injection (``DEEPSHARD_FAULT_SAVE_STALL=STEP:SECONDS``): pause with the shards written."""
    seconds = _stall_seconds(step, "sealing")
    if seconds is not None:
        time.sleep(seconds)


def slow_write_seconds(step: int) -> float | None:
    """Fault injection (``DEEPSHARD_FAULT_SAVE_STALL=STEP:SECONDS:slow``): how long the first write of this
    save's shard file takes (``progress.ProgressWriter``'s pace), None for a write at full speed."""
    return _stall_seconds(step, "slow")


class MidShardStall(ModuleOrderPlanner):
    """Fault injection (``DEEPSHARD_FAULT_SAVE_STALL=STEP:SECONDS:shard``): the save planner, which pauses
    once this rank's first tensor is in its shard file and the next is due (the file open, half written)."""

    def __init__(self, step: int, seconds: float) -> None:
        super().__init__()
        self.step, self.seconds, self.tensors = step, seconds, 0

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type != WriteItemType.BYTE_IO:
            self.tensors += 1
            if self.tensors == 2:
                _say_paused(f"{self.step}:{self.seconds:g}:shard", "shard")
                time.sleep(self.seconds)
        return super().resolve_data(write_item)


def save_planner(step: int) -> DefaultSavePlanner:
    """The save's planner (:class:`ModuleOrderPlanner`), or the fault-injection one when a mid-shard pause is
    asked for."""
    seconds = _stall_seconds(step, "shard", now=False)
    return ModuleOrderPlanner() if seconds is None else MidShardStall(step, seconds)


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 10e6 else f"{n / 1e6:.1f} MB"


def free_space_check(root: Path, needed: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if free < needed:
        raise CheckpointError(f"needs {_mb(needed)}, {_mb(free)} free")


def clean_up(root: Path, partial: list[Path], reason: str, needed: int) -> str:
    """Remove a failed save's temp dirs (``partial``: those this save created, nothing else); the
    failure's reason, saying so when the disk filled up (a full disk shows up as ENOSPC, or as a
    torch.save zip-writer 'enforce fail')."""
    free = shutil.disk_usage(root).free if root.is_dir() else needed
    partial = [p for p in partial if p.exists()]
    for p in partial:
        shutil.rmtree(p, ignore_errors=True)
        log.info("checkpoint: removed %s, the temp dir of this failed save", p)
    full = reason.startswith("ENOSPC ")
    reason = reason.removeprefix("ENOSPC ")
    if (full or free < MARGIN_BYTES) and not reason.startswith("needs "):  # not the up-front check's own
        reason = f"the disk is full: needs {_mb(needed)}, {_mb(free)} were free ({reason})"
    if partial:
        reason += f"; removed the partial {partial[0].name}"
    return reason


