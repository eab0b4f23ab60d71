"""Parameters on NVMe (ZeRO-Infinity): each FSDP2 unit's shards live in a swap file between uses.

A *unit* is one ``fully_shard`` group (a transformer block, or the root's embeddings, final norm
and head).  Its FSDPParams' sharded storages are freed (``untyped_storage().resize_(0)``, FSDP2's
own way of freeing unsharded params) once the unit's all-gather has copied them out, and refilled
from the swap file right before its next all-gather.  Refills come through a small pool of
page-aligned buffers (O_DIRECT), read ``param_prefetch`` units ahead of use: forward order in
forward, reverse order in backward, on the same :class:`~deepshard.offload.aio.AioEngine` as the
optimizer swap.

Hooks: three methods of each unit's ``FSDPParamGroup`` are wrapped on the instance (never the
class): ``unshard`` (refill first, then read ahead), ``wait_for_unshard`` (after it, the
unsharded params hold the data: free the shards) and ``post_backward`` (after the reduce-scatter,
the unit's gradient shards go to the gradient swap file, accumulated there across micro-steps,
and ``.grad`` is dropped, so no whole-model gradient is ever resident).  Each gradient's norm is
taken when it is written, so the optimizer's global norm needs no gradient in memory
(:meth:`ParamSwap.grad_norms`).  The optimizer step itself (:mod:`.infinity_store`) runs unit by
unit on the same files, each unit's update deferred to its unshard in the next forward (a
:class:`Deferred`): each shard is read once and written once per step, behind the forward.

File layout (one set per rank, all four files alike): unit ``u`` at byte ``unit.offset``; inside
it each FSDPParam's padded flat shard at a multiple of 16 elements; fp32 throughout (stage 3's
sharded params are the fp32 masters).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from . import scratch
from .aio import AioEngine, AioRequest, SwapFile, align_up, aligned_empty, as_buffer
from .config import OffloadConfig, validate_param_swap
from .param_init import fixed_mmap_threshold

FILES = ("param", "exp_avg", "exp_avg_sq", "grad")
VEC = 16  # elements: every shard starts on a 64-byte line (torch's fused CPU AdamW unit)


class Deferred(Protocol):
    """The optimizer's update of each unit, deferred until the unit is next needed (the next
    forward's unshard): :mod:`.infinity_store` implements it."""

    def owes(self, unit: Unit) -> bool: ...
    def reading(self, unit: Unit) -> bool: ...
    def held(self, unit: Unit) -> torch.Tensor | None: ...
    def read_ahead(self, unit: Unit) -> bool: ...
    def apply(self, unit: Unit, *, land: bool) -> None: ...
    def drain(self) -> None: ...
    def idle(self) -> None: ...


def retire_write(writes: deque, *, wait: bool) -> Any:
    """The buffer of the oldest ``(buffer, requests)`` write in ``writes``, popped once its requests
    are done (with ``wait``: once waited for); None while it is still in flight."""
    if writes and (wait or all(r.done() for r in writes[0][1])):
        buf, reqs = writes.popleft()
        for r in reqs:
            r.wait()
        return buf
    return None


@dataclass
class Slot:
    """One FSDPParam's place in its unit: ``numel`` padded elements from ``offset``; the first
    ``local_numel`` are the shard the optimizer updates; ``index`` in the store's param list."""

    fsdp_param: Any
    offset: int
    numel: int
    local_numel: int
    index: int

    @property
    def data(self) -> torch.Tensor:
        return self.fsdp_param._sharded_param_data


@dataclass
class Unit:
    name: str
    group: Any  # FSDPParamGroup
    slots: list[Slot] = field(default_factory=list)
    numel: int = 0
    offset: int = 0  # bytes into every swap file
    resident: bool = True  # materialized params start in memory (written to the file on open)
    pending: tuple[torch.Tensor, list[AioRequest]] | None = None  # a read in flight into a pool buffer
    grad_written: bool = False  # this step's gradient (so far) is in the grad file
    written: set[int] = field(default_factory=set)  # slots the materializer saw written

    @property
    def nbytes(self) -> int:
        return align_up(self.numel * 4)


def _wrap(obj: Any, name: str, *, before: Any = None, after: Any = None) -> None:
    """Replace ``obj.name`` on the instance by the same bound method with hooks around it."""
    orig = getattr(obj, name)

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        out = orig(*args, **kwargs)
        if after is not None:
            after()
        return out

    setattr(obj, name, wrapped)


class ParamSwap:
    """Owns the per-rank swap files of params, grads and Adam moments, and the FSDP hooks."""

    def __init__(self, config: OffloadConfig, *, rank: int = 0, run_id: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.run_id = run_id or f"pid{os.getpid()}"
        self.units: list[Unit] = []
        self.files: dict[str, SwapFile] = {}
        self.engine: AioEngine | None = None
        self.dir = None
        self.num_params = 0
        self._pool: list[torch.Tensor] = []
        self._writes: deque[tuple[torch.Tensor, list[AioRequest]]] = deque()
        self._norms: list[torch.Tensor] = []
        self._by_storage: dict[int, tuple[Unit, Slot]] = {}
        # unit refills: waited for at use / read ahead / from the deferred update's buffers
        self.reads = {"demand": 0, "prefetched": 0, "kept": 0}
        self.deferred: Deferred | None = None  # the optimizer's update still owed to some units

    # -- wiring ---------------------------------------------------------------------------------

    def attach(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """Hook the FSDP units of ``model`` (after ``fully_shard``): the root first, then ``blocks``
        in forward order.  Params may still be on the meta device; the files open in :meth:`open`."""
        fixed_mmap_threshold()
        for name, module in [("root", model)] + [(f"block{i}", b) for i, b in enumerate(blocks)]:
            group = module._get_fsdp_state()._fsdp_param_group
            if group is None:
                continue
            for attr in ("unshard", "wait_for_unshard", "post_backward", "fsdp_params", "is_sharded"):
                assert hasattr(group, attr), f"torch's FSDPParamGroup has no {attr}: param swap needs updating"
            unit = Unit(name, group)
            self.units.append(unit)
            _wrap(group, "unshard", before=functools.partial(self._before_unshard, unit))
            _wrap(group, "wait_for_unshard", after=functools.partial(self._after_unshard, unit))
            _wrap(group, "post_backward", after=functools.partial(self._after_post_backward, unit))
        for p in model.parameters():
            if not p.requires_grad:
                raise ValueError("offload.params='nvme' does not support frozen parameters yet (+peft=lora): "
                                 "use offload.params=cpu or none")

    def _layout(self) -> None:
        """Place the (materialized, maybe still untouched) shards; check space and buffers; create
        the files (fresh: unwritten preallocated blocks read as zeros, the moments' initial value)."""
        offset = 0
        for unit in self.units:
            pos = 0
            for fp in unit.group.fsdp_params:
                data = fp._sharded_param_data
                assert data.dtype == torch.float32, f"{fp}: sharded params must be fp32 masters, got {data.dtype}"
                assert data.storage_offset() == 0 and data.untyped_storage().nbytes() == data.numel() * 4, \
                    f"{fp}: the shard does not own its storage; it cannot be swapped"
                pos = -(-pos // VEC) * VEC
                unit.slots.append(Slot(fp, pos, data.numel(), fp.sharded_param._local_tensor.numel(), -1))
                pos += data.numel()
            unit.numel = pos
            unit.offset = offset
            offset += unit.nbytes
        self._by_storage = {s.data.untyped_storage()._cdata: (u, s) for u in self.units for s in u.slots}
        largest = max(self.units, key=lambda u: u.numel)
        validate_param_swap(self.config, len(FILES) * max(offset, 1), largest.numel, largest.name)
        self.dir = scratch.make_store_dir(self.config.nvme_path, self.run_id, self.rank)
        try:
            for k in FILES:
                path = self.dir / f"{k}.swp"
                path.unlink(missing_ok=True)
                self.files[k] = SwapFile(str(path), max(offset, 1))
            self.engine = AioEngine(self.config.aio)
            self._pool = [aligned_empty(largest.nbytes, pin=torch.cuda.is_available())
                          for _ in range(self.config.param_buffer_count)]
        except BaseException:
            self.close()
            raise

    def open(self, params: list[torch.Tensor]) -> None:
        """Bind the store's tensors (each a local shard; their order is the optimizer's) to the slots.

        Without :meth:`materializer` the shards are laid out and written to the file here."""
        if self.engine is None:
            self._layout()
            try:
                for unit in self.units:
                    self._flush(unit, release=False)
            except BaseException:
                self.close()
                raise
        for i, p in enumerate(params):
            found = self._by_storage.get(p.untyped_storage()._cdata)
            assert found is not None, f"param {i} of the optimizer is not a swapped shard"
            found[1].index = i
        assert sorted(s.index for u in self.units for s in u.slots) == list(range(len(params)))
        self.num_params = len(params)
        self._norms = [torch.zeros(1) for _ in params]

    def _flush(self, unit: Unit, *, release: bool) -> None:
        """The unit's shards -> the param file (through a pool buffer); then free them if ``release``."""
        buf = self._free_buffer(wait=True)
        assert buf is not None
        f32 = buf[:unit.nbytes].view(torch.float32)
        f32.zero_()
        for s in unit.slots:
            f32[s.offset:s.offset + s.numel].copy_(s.data)
        self._io(unit, "param", buf, write=True).wait()
        if release:
            self._release(unit, force=True)

    def materializer(self, init_fn: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
        """Wrap a sharded model's ``materialize(model)`` so no more than a unit or two is ever
        initialized in memory (:func:`.param_init.unit_by_unit`)."""
        from .param_init import unit_by_unit

        return unit_by_unit(self, init_fn)

    # -- I/O helpers ----------------------------------------------------------------------------

    def _io(self, unit: Unit, key: str, buf: torch.Tensor, *, write: bool) -> AioRequest:
        assert self.engine is not None
        view = as_buffer(buf[:unit.nbytes])
        op = self.engine.write if write else self.engine.read
        return op(self.files[key].fd, view, unit.offset)

    def _free_buffer(self, *, wait: bool) -> torch.Tensor | None:
        """A pool buffer no read or write targets; retires finished (or, with ``wait``, the oldest)
        gradient writes to find one.  None when every buffer holds a read ahead and not ``wait``."""
        busy = {id(b) for b, _ in self._writes} | {id(u.pending[0]) for u in self.units if u.pending}
        for b in self._pool:
            if id(b) not in busy:
                return b
        freed = retire_write(self._writes, wait=wait)
        if freed is not None:
            return freed
        if wait:  # every buffer holds a read ahead: land the oldest one early
            unit = next(u for u in self.units if u.pending)
            b = unit.pending[0]
            self._land(unit)
            return b
        return None

    def _held(self, unit: Unit) -> torch.Tensor | None:
        return None if self.deferred is None else self.deferred.held(unit)

    def _read_ahead(self, unit: Unit, *, wait: bool) -> bool:
        if unit.resident or unit.pending is not None or self._held(unit) is not None:
            return True
        buf = self._free_buffer(wait=wait)
        if buf is None:
            return False
        unit.pending = (buf, [self._io(unit, "param", buf, write=False)])
        return True

    def _land(self, unit: Unit) -> None:
        """Wait for the unit's read and refill its FSDPParams' shard storages from the buffer."""
        assert unit.pending is not None
        buf, reqs = unit.pending
        for r in reqs:
            r.wait()
        self.fill(unit, buf[:unit.nbytes].view(torch.float32))
        unit.pending = None

    def fill(self, unit: Unit, f32: torch.Tensor) -> None:
        """Refill the unit's FSDPParams' shard storages from ``f32`` (the unit's flat layout)."""
        with torch.no_grad():
            for s in unit.slots:
                data = s.data
                data.untyped_storage().resize_(s.numel * 4)
                with torch.autograd._unsafe_preserve_version_counter(data):
                    data.copy_(f32[s.offset:s.offset + s.numel])
        unit.resident = True

    def _owed(self, unit: Unit) -> bool:
        return self.deferred is not None and self.deferred.owes(unit)

    def _ensure(self, unit: Unit) -> None:
        if unit.resident:
            return
        if self._owed(unit):  # the last step's update of this unit runs now, and lands its params
            assert self.deferred is not None
            self.reads["prefetched" if self.deferred.reading(unit) else "demand"] += 1
            self.deferred.apply(unit, land=True)
            return
        held = self._held(unit)
        if held is not None and unit.pending is None:  # the update's buffer still has them
            self.reads["kept"] += 1
            self.fill(unit, held)
            return
        self.reads["prefetched" if unit.pending is not None else "demand"] += 1
        self._read_ahead(unit, wait=True)
        self._land(unit)

    def _release(self, unit: Unit, *, force: bool = False) -> None:
        """Free the unit's shard storages (its file copy is current), unless ``max_in_cpu`` lets
        used shards stay resident."""
        if not unit.resident:
            return
        if not force and self.resident_numel() <= self.config.max_in_cpu:
            return
        for s in unit.slots:
            s.data.untyped_storage().resize_(0)
        unit.resident = False
        unit.written = set()

    def resident_numel(self) -> int:
        return sum(u.numel for u in self.units if u.resident)

    # -- FSDP hooks -----------------------------------------------------------------------------

    def _before_unshard(self, unit: Unit) -> None:
        if self.engine is None or not unit.group.is_sharded:
            return  # not opened yet (a forward before the store exists), or nothing to gather
        self._ensure(unit)
        backward = unit.group._training_state == TrainingState.PRE_BACKWARD
        order = self.units[::-1] if backward else self.units
        k = order.index(unit)
        for nxt in order[k + 1:k + 1 + self.config.param_prefetch]:
            if not nxt.group.is_sharded:
                continue
            if self._owed(nxt):
                assert self.deferred is not None
                if not self.deferred.read_ahead(nxt):
                    break
            elif not self._read_ahead(nxt, wait=False):
                break

    def _after_unshard(self, unit: Unit) -> None:
        if self.engine is not None and unit.group.is_unsharded:
            self._release(unit)  # the all-gather output holds the data now

    def _after_post_backward(self, unit: Unit) -> None:
        """This unit's reduced gradient shards -> the gradient file (accumulated), then dropped."""
        if self.engine is None:
            return
        assert not self._owed(unit), f"{unit.name}: a gradient reached a unit whose last update is still owed"
        if self.deferred is not None:
            self.deferred.idle()
        grads = []
        for s in unit.slots:
            p = s.fsdp_param.sharded_param
            event = getattr(s.fsdp_param, "grad_offload_event", None)
            if event is not None:  # CPUOffloadPolicy's device->host copy of the reduced grad
                event.synchronize()
            g = p.grad
            grads.append(None if g is None else g._local_tensor if hasattr(g, "_local_tensor") else g)
        if all(g is None for g in grads):
            return
        buf = self._free_buffer(wait=True)
        assert buf is not None
        f32 = buf[:unit.nbytes].view(torch.float32)
        if unit.grad_written:  # grad accumulation: FSDP2 would add into .grad; add into the file's
            self._io(unit, "grad", buf, write=False).wait()
        else:
            f32.zero_()
        views = []
        with torch.no_grad():
            for s, g in zip(unit.slots, grads):
                view = f32[s.offset:s.offset + s.local_numel]
                if g is not None:
                    if unit.grad_written:
                        view.add_(g.reshape(-1))
                    else:
                        view.copy_(g.reshape(-1))
                views.append(view)
            for s, n in zip(unit.slots, torch._foreach_norm(views, 2, dtype=torch.float32)):
                self._norms[s.index] = n.reshape(1)
        self._writes.append((buf, [self._io(unit, "grad", buf, write=True)]))
        unit.grad_written = True
        for s in unit.slots:
            s.fsdp_param.sharded_param.grad = None

    # -- for the optimizer ----------------------------------------------------------------------

    def grad_norms(self) -> list[torch.Tensor]:
        """One 1-element fp32 tensor per param (store order): the 2-norm of its local gradient
        shard, taken when written.  Their squares sum to the squared norm of all local gradients,
        so the optimizer's global-norm all-reduce and clipping see the same value as with
        resident gradients (``||[n]|| = n`` exactly)."""
        return list(self._norms)

    def finish_writes(self) -> None:
        while self._writes:
            _, reqs = self._writes.popleft()
            for r in reqs:
                r.wait()

    def zero_grad(self) -> None:
        """The step consumed (or skipped) the gradients: the next backward starts a fresh sum."""
        self.finish_writes()
        for unit in self.units:
            unit.grad_written = False
        self._norms = [torch.zeros(1) for _ in range(self.num_params)]

    def release_all(self) -> None:
        """Drop every resident shard (before the step rewrites the param file)."""
        for unit in self.units:
            if unit.pending is not None:
                self._land(unit)
            self._release(unit, force=True)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """All shards in memory inside the block (inspection, small exports), released after."""
        for unit in self.units:
            self._ensure(unit)
        try:
            yield
        finally:
            self.release_all()

    def resident_bytes(self) -> int:
        return 4 * sum(s.numel for u in self.units if u.resident for s in u.slots)

    def pool_bytes(self) -> int:
        return sum(b.numel() for b in self._pool)

    def nvme_bytes(self) -> int:
        return len(FILES) * sum(u.nbytes for u in self.units)

    def io_stats(self) -> dict[str, float]:
        assert self.engine is not None
        e = self.engine
        return {"read_bytes": e.bytes[False], "write_bytes": e.bytes[True],
                "read_busy_s": e.busy_s[False], "write_busy_s": e.busy_s[True], "io_busy_s": e.busy_s[None],
                **self.reads}

    def reset_io_stats(self) -> None:
        if self.engine is not None:
            self.engine.reset_stats()
        self.reads = {"demand": 0, "prefetched": 0, "kept": 0}

    def close(self) -> None:
        """Stop the I/O threads, close and delete the swap files (idempotent)."""
        if self.deferred is not None:
            with contextlib.suppress(OSError):
                self.deferred.drain()
        if self.engine is not None:
            for unit in self.units:
                if unit.pending is not None:
                    for r in unit.pending[1]:
                        with contextlib.suppress(OSError):
                            r.wait()
                    unit.pending = None
            with contextlib.suppress(OSError):
                self.finish_writes()
            self.engine.close()
            self.engine = None
        for f in self.files.values():
            f.close()
        self.files = {}
        self._pool = []
        if self.dir is not None:
            scratch.unregister(self.dir)
            scratch.remove_dir(self.dir)
            self.dir = None
