"""Asynchronous saves: the step's state is copied into host buffers, a writer thread does the rest.

The step is blocked only while :class:`HostStaging` copies this rank's tensors of the DCP state
(fp32 masters and AdamW moments, wherever the state store keeps them, plus any weights outside the
optimizer) into host buffers allocated at the first save and reused by every later one (pinned when
a GPU is present, so the copy is a DMA).  A writer thread then runs the very same
:func:`~deepshard.core.checkpoint.state.write_checkpoint` as a synchronous save — free-space check,
DCP shards, JSON, a crc32 of every file, the manifest, the atomic publish — from the staged copy, over
its own gloo process group created up front (DCP's save is collective, and the training thread's
collectives must never interleave with it on one group).  So an asynchronous checkpoint is the same
bytes, verified and sealed the same way, and the previous one stays the newest good until it is sealed.

At most one save is in flight.  Whether one is, is agreed by every rank (one tiny all-reduce on the
training group, per step while a save is in flight): a save's outcome is harvested only once every
rank's writer has finished, so a failure (CheckpointSaveError, one line) surfaces on every rank at
the same step; a save requested while one is writing either waits for it or is skipped (``policy``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from deepshard.core.checkpoint import progress
from deepshard.core.checkpoint.failures import CheckpointSaveError
from deepshard.core.checkpoint.request import SaveRequest, mesh_on
from deepshard.core.checkpoint.state import write_checkpoint

log = logging.getLogger("deepshard.checkpoint")

POLICIES = ("wait", "skip")


class HostStaging:
    """One host buffer per tensor of the DCP state, sized at the first save and reused.

    A state store's tensors are copied whatever their residence: device state (a GPU's, or the CPU
    on a CPU-only host) into pinned host buffers; host-offloaded state (``offload.device=cpu``) with
    one memcpy, since the next step updates it in place; ZeRO-Infinity's state from its mapped swap
    files (a read of what the page cache does not hold).  That is one copy of this rank's checkpoint
    state, held for the run (``bench/bench_checkpoint.py`` measures it).  Tensors a store made for the save
    (the NVMe optimizer store reads its swap files into fresh tensors: ``request.FRESH_STATE_DICT``) are
    adopted as they are, not copied: no buffer is kept for them and they live until the save is written.
    """

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.staged: dict[str, Any] = {}
        self._layout: dict[str, tuple] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def _allocate(self, state: dict[str, Any], adopt: frozenset[str]) -> None:
        pin = torch.cuda.is_available()
        self.buffers, self.staged, self._layout = {}, {}, {}
        for key, value in state.items():
            if key in adopt:  # never kept here: the returned dict carries it for this save only
                continue
            if not isinstance(value, torch.Tensor):
                self.staged[key] = value
                continue
            local = value.to_local() if isinstance(value, DTensor) else value
            buf = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin)
            self.buffers[key] = buf
            if isinstance(value, DTensor):
                self.staged[key] = DTensor.from_local(buf, mesh_on(value.device_mesh, "cpu"), value.placements,
                                                      run_check=False, shape=value.shape, stride=value.stride())
            else:
                self.staged[key] = buf
            self._layout[key] = (tuple(value.shape), tuple(local.shape), value.dtype)
        log.info("checkpoint: %.1f MB of %shost memory hold this rank's staged state for asynchronous saves "
                 "(allocated once, reused)", self.nbytes / 1e6, "pinned " if pin else "")

    def _layout_of(self, state: dict[str, Any], adopt: frozenset[str]) -> dict[str, tuple]:
        out = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key not in adopt:
                local = value.to_local() if isinstance(value, DTensor) else value
                out[key] = (tuple(value.shape), tuple(local.shape), value.dtype)
        return out

    def stage(self, state: dict[str, Any], adopt: frozenset[str] = frozenset()) -> dict[str, Any]:
        """``state`` copied into the buffers (allocated now if this is the first save, or if the state's
        layout changed), the tensors of the keys in ``adopt`` taken as they are (fresh, the caller's to
        give away); returns the staged DCP state dict, valid until the next :meth:`stage`."""
        if self._layout_of(state, adopt) != self._layout:
            self._allocate(state, adopt)
        with torch.no_grad():
            for key, buf in self.buffers.items():
                value = state[key]
                local = value.to_local() if isinstance(value, DTensor) else value
                buf.copy_(local.detach(), non_blocking=buf.is_pinned())
                progress.report(buf.numel() * buf.element_size())  # an NVMe store's state is read here: progress
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        # adopted tensors live in the returned dict only (the request's), not past the save
        return {**self.staged, **{key: state[key] for key in adopt}}


@dataclass
class SaveOutcome:
    """One asynchronous save, once every rank's writer is done: ``path`` (sealed) or ``error``."""

    step: int
    path: Path | None
    error: CheckpointSaveError | None
    blocked_s: float  # the training thread's time in staging
    write_s: float  # from the request to sealed (or failed)
    nbytes: int


def training_timeout(device: torch.device) -> timedelta | None:
    """The collective timeout the training group was made with (``init_distributed(timeout_s=)``, the app's
    ``launcher.timeout_s``), so that a writer waiting on a dead rank gives up when training would, not
    after gloo's default 30 minutes.  None (gloo's default) when it cannot be read."""
    if not dist.is_initialized():
        return None
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(device)
        return backend.options._timeout
    except (AttributeError, RuntimeError):
        return None


WRITER_NICE = 10  # the writer thread's niceness: on a busy host the step goes first, the writer takes the rest


def _yield_to_training() -> None:
    """Lower this (writer) thread's CPU priority: where the cores are all busy training, checksumming and
    writing would otherwise take their time from the step; when training waits (the end of a run, a save
    due while this one writes) the writer has the CPUs to itself.  Linux schedules threads one by one."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError):  # not Linux: the writer runs at the training thread's priority
        pass


class AsyncCheckpointer:
    """Staging plus one writer thread; create it on every rank at the same point (it makes a group).

    The writer's gloo group times out like the training group (``timeout_s``, default: the training
    group's own timeout).

    ``on_sealed(path)`` runs in the writer thread on every rank after a successful save (rank 0 prunes
    there: retention counts the new checkpoint only once it is sealed).
    """

    def __init__(self, *, device: torch.device, on_sealed: Any = None, timeout_s: float | None = None) -> None:
        self.device = device  # where the training group's all-reduce runs (nccl: the GPU)
        self.timeout = timedelta(seconds=timeout_s) if timeout_s else training_timeout(device)
        self.group = dist.new_group(backend="gloo", timeout=self.timeout) if dist.is_initialized() else None
        self.staging = HostStaging()
        self.on_sealed = on_sealed
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] = {}
        self._pending: dict[str, Any] | None = None  # the in-flight save's step, times, bytes

    @property
    def in_flight(self) -> bool:
        """A save was started and its outcome not harvested yet (this rank's view)."""
        return self._pending is not None

    def _writer(self, request: SaveRequest) -> None:
        _yield_to_training()
        try:
            path = write_checkpoint(request, self.group)
            if self.on_sealed is not None:
                self.on_sealed(path)
            self._result.update(path=path, error=None)
        except CheckpointSaveError as err:
            self._result.update(path=None, error=err)
        except BaseException as err:  # noqa: BLE001 - reported, as one line, on the training thread
            self._result.update(path=None, error=CheckpointSaveError(request.root, request.step,
                                                                     f"{type(err).__name__}: {err}"))
        self._result["done_at"] = time.perf_counter()

    def any_writing(self) -> bool:
        """True on every rank while some rank's writer is still running (one tiny all-reduce)."""
        if self._pending is None:
            return False
        busy = torch.tensor([0.0 if self._result.get("done_at") else 1.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        return bool(busy.item())

    def poll(self) -> SaveOutcome | None:
        """The in-flight save's outcome once every rank's writer is done (the same on every rank), else None.
        Collective: call it on every rank at the same point of the loop."""
        if self._pending is None or self.any_writing():
            return None
        return self._harvest()

    def wait(self) -> SaveOutcome | None:
        """Block until the in-flight save (if any) is sealed or failed; its outcome, on every rank."""
        if self._pending is None:
            return None
        assert self._thread is not None
        self._thread.join()
        return self._harvest()

    def make_room(self, policy: str) -> tuple[bool, SaveOutcome | None]:
        """Before a due save (after this step's :meth:`poll`): whether to start it, and the outcome of
        the save it waited for.  ``wait``: block until the in-flight save is done; ``skip``: do not save
        while one is in flight.  The same answer on every rank (``in_flight`` changes only at a harvest)."""
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: valid policies are {', '.join(POLICIES)}")
        if self._pending is None:
            return True, None
        if policy == "skip":
            return False, None
        return True, self.wait()

    @property
    def writing_step(self) -> int | None:
        return None if self._pending is None else self._pending["step"]

    def _harvest(self) -> SaveOutcome:
        assert self._pending is not None and self._thread is not None
        self._thread.join()  # done already; joins the thread
        pending, result = self._pending, self._result
        self._pending, self._thread, self._result = None, None, {}
        return SaveOutcome(step=pending["step"], path=result["path"], error=result["error"],
                           blocked_s=pending["blocked_s"], write_s=result["done_at"] - pending["start"],
                           nbytes=pending["nbytes"])

    def start(self, request: SaveRequest, *, since: float | None = None) -> float:
        """Stage ``request``'s state (blocking: the seconds it took are returned) and start its writer.
        ``since``: when the caller began to build the request (``time.perf_counter()``), so that a store
        whose ``state_dict`` reads its state (NVMe) counts that read as blocked time too.  The caller has
        made sure that no save is in flight (:meth:`wait` or :meth:`poll`)."""
        assert self._pending is None, "one asynchronous save at a time"
        start = time.perf_counter() if since is None else since
        request.state = self.staging.stage(request.state, request.fresh)
        blocked = time.perf_counter() - start
        self._pending = {"step": request.step, "start": start, "blocked_s": blocked, "nbytes": request.nbytes}
        self._thread = threading.Thread(target=self._writer, args=(request,), name=f"checkpoint-{request.step}",
                                        daemon=True)
        self._thread.start()
        return blocked

    def close(self) -> SaveOutcome | None:
        """Wait for the in-flight save; its outcome (None when there was none)."""
        return self.wait()
