"""The optimizer side of ZeRO-Infinity: AdamW unit by unit on the parameter swap's files.

With ``offload.params=nvme`` the sharded fp32 params *are* the master weights and live in the
param swap file (:mod:`.param_swap`), beside the gradient and both Adam moment files.  Units go
through ``buffer_count`` buffers of 16 bytes per element (param, exp_avg, exp_avg_sq, grad),
allocated once: each shard is read once and written once per step and no model-sized host tensor
ever exists.  The gradients given to :meth:`step` are the swap's per-param norms (the real ones
are in the grad file).

The update is *deferred* (:class:`DeferredStep`): :meth:`InfinityStore.step` only records lr,
step and gradient scale and starts reading the first units; each unit is then updated when it is
next needed, at its unshard in the next forward, in forward order, while the read of the next
``param_prefetch`` units and the write-back of the previous ones are in flight behind the
forward's compute.  The updated params land straight in the unit's shards, so the forward reads
no param file of its own.  The arithmetic is the same :func:`adamw_update` on the same unit, so
the result is bit-identical to an eager step; anything that reads the files (a checkpoint save,
:meth:`ParamSwap.resident`) first runs the updates still owed.  With as many buffers as units
(*resident*) the buffers keep every unit's state and gradient between steps: a step then reads
nothing and writes 12 bytes per element (see :class:`DeferredStep`).
"""

from __future__ import annotations

import mmap
import os
from collections import deque

import torch

from deepshard.core.state_store import AdamWConfig, StateStore, adamw_update

from .aio import AioRequest, as_buffer
from .nvme_store import _Buffer
from .param_swap import ParamSwap
from .streaming import retire_write, stream_groups
from .unit_swap import Unit

STATES = ("param", "exp_avg", "exp_avg_sq")
_REGION = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "grad": "grad"}


class InfinityStore(StateStore):
    """AdamW state (and the params themselves) in the :class:`ParamSwap`'s files."""

    def __init__(self, params: list[torch.Tensor], weight_decays: list[float], adamw: AdamWConfig, *,
                 swap: ParamSwap) -> None:
        super().__init__(params, weight_decays, adamw)
        self.swap = swap
        swap.open(params)
        self.numel = sum(p.numel() for p in params)
        self.buffers: list[_Buffer] = []  # while a step's updates are owed (see DeferredStep.idle)
        self.deferred = DeferredStep(self)
        swap.deferred = self.deferred

    def buffer_count(self) -> int:
        return min(self.swap.config.buffer_count, len(self.swap.units))

    def ensure_buffers(self) -> None:
        if not self.buffers:
            largest = max(u.numel for u in self.swap.units)
            self.buffers = [_Buffer(largest, torch.cuda.is_available()) for _ in range(self.buffer_count())]

    def _io(self, unit: Unit, buf: _Buffer, keys: tuple[str, ...], *, write: bool) -> list[AioRequest]:
        engine = self.swap.engine
        assert engine is not None
        op = engine.write if write else engine.read
        n = unit.nbytes
        raw = as_buffer(buf.raw)
        out = []
        for k in keys:
            start = _offset(buf, _REGION[k])
            out.append(op(self.swap.files[k].fd, raw[start:start + n], unit.offset))
        return out

    def _write_all(self, fn) -> None:
        """``fn(unit index, buffer)`` fills each unit's states in a buffer, written behind the next."""
        units = self.swap.units
        self.deferred.forget()  # every buffer free, no request in flight
        self.ensure_buffers()
        stream_groups(len(units), self.buffers, fn, read_io=None,
                      write_io=lambda g, b: self._io(units[g], b, STATES, write=True),
                      overlap=self.swap.config.aio.overlap_events)

    def step(self, grads: list[torch.Tensor], *, lr: float, step: int, grad_scale: float = 1.0) -> None:
        """Record the update; each unit's runs at its next use (:class:`DeferredStep`)."""
        swap = self.swap
        swap.finish_writes()
        self.deferred.run_all()  # two steps with no forward between: the first one's updates first
        swap.release_all()  # resident copies would be stale after the update
        self.deferred.start(lr=lr, step=step, grad_scale=grad_scale)

    def update(self, unit: Unit, buf: _Buffer, *, lr: float, step: int, grad_scale: float) -> None:
        """AdamW on one unit whose param, moments and gradient are in ``buf``."""
        slots = unit.slots
        views = {k: [buf.f32[_REGION[k]][s.offset:s.offset + s.local_numel] for s in slots]
                 for k in STATES + ("grad",)}
        adamw_update(views["param"], views["grad"], views["exp_avg"], views["exp_avg_sq"],
                     [self.weight_decays[s.index] for s in slots], self.adamw, lr=lr, step=step,
                     grad_scale=grad_scale)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        """Views of the swap files themselves (``master`` is the params), mapped, not read: a
        checkpoint save streams them from the page cache and no copy of the state is made.  The
        views are for the save (or a load) at hand: the next step rewrites the files.

        Each tensor's storage is only its own bytes (:func:`map_file`): DCP's writer clones a tensor whose
        storage is larger than the tensor and keeps every clone of a file until the file is written,
        which made a save hold the rank's whole state in anonymous memory (OOM-killed in a cgroup the
        training fitted in); clean mapped pages are reclaimable."""
        self.swap.finish_writes()
        self.deferred.run_all()
        out: dict[str, list[torch.Tensor]] = {}
        for k in STATES:
            region = map_file(self.swap.files[k].path)
            views: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
            for unit in self.swap.units:
                for s in unit.slots:
                    views[s.index] = region(unit.offset + 4 * s.offset, s.local_numel).view(self.params[s.index].shape)
            out[_REGION[k]] = views
        return out

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Masters become the params (written to the param file), moments to theirs (a load into
        :meth:`state_dict`'s views lands in private copies of the mapped pages, copied here)."""
        self.deferred.drop()  # the loaded state replaces whatever update was still owed
        self.swap.release_all()
        flat = {key: [t.detach().reshape(-1) for t in state[key]] for key in ("master", "exp_avg", "exp_avg_sq")}

        def scatter(g: int, buf: _Buffer) -> None:
            unit = self.swap.units[g]
            for k in STATES:
                region = buf.f32[_REGION[k]]
                region[:unit.numel].zero_()  # FSDP's padding stays zero
                for s in unit.slots:
                    region[s.offset:s.offset + s.local_numel].copy_(flat[_REGION[k]][s.index])

        self._write_all(scatter)

    def state_bytes(self) -> dict[str, int]:
        return {"device": 0, "host": 0, "nvme": 12 * self.numel}

    def buffer_bytes(self) -> dict[str, int]:
        return {"param_swap_pool": self.swap.pool_bytes()}

    def io_stats(self) -> dict[str, float]:
        return self.swap.io_stats()

    def reset_io_stats(self) -> None:
        self.swap.reset_io_stats()

    def close(self) -> None:
        self.swap.close()  # drains the deferred step's requests first


def _offset(buf: _Buffer, key: str) -> int:
    """Byte offset of a region in the buffer's raw allocation."""
    return buf.f32[key].data_ptr() - buf.raw.data_ptr()


class DeferredStep:
    """The updates a step still owes, each run at the unit's next use (see the module docstring).

    ``owed`` maps a unit's index to whether the step had a gradient for it (read from the grad
    file unless its buffer holds it); ``reads`` are read-aheads in flight into a buffer, ``writes``
    the write-backs of updated units (their buffer is free once they finish); ``holds`` the buffers
    that still hold a unit's current param and moments (those of its file, until reused), least
    recently updated first: the backward right after the forward, which needs the last units
    first, refills them from there instead of reading the param file again, and the next update of
    a held unit reads no state.  ``grads``: units whose gradient (this step's sum so far) is in
    their held buffer instead of the grad file.

    When the buffers outnumber the units (``buffer_count >= units``: *resident*, a model small
    enough that its 16 B/elt fit in the buffers the forward holds anyway) they are kept for the
    whole run: every unit stays held, its gradient goes to its buffer, and a step reads nothing
    and writes each unit's param and moments once (12 B/elt, behind the forward).  Otherwise they
    are freed at the backward's first gradient, so the backward's activations never meet them."""

    def __init__(self, store: InfinityStore) -> None:
        self.store = store
        self.swap = store.swap
        self.index = {id(u): i for i, u in enumerate(self.swap.units)}
        self.resident = store.buffer_count() >= len(self.swap.units)
        self.owed: dict[int, bool] = {}
        self.args: dict[str, float] = {}
        self.reads: dict[int, tuple[_Buffer, list[AioRequest]]] = {}
        self.writes: deque[tuple[_Buffer, list[AioRequest]]] = deque()
        self.holds: dict[int, _Buffer] = {}
        self.grads: set[int] = set()
        self.overlap = self.swap.config.aio.overlap_events  # False: no read ahead, writes waited for

    def start(self, *, lr: float, step: int, grad_scale: float) -> None:
        assert not self.owed and not self.reads
        self.store.ensure_buffers()
        self.args = {"lr": lr, "step": step, "grad_scale": grad_scale}
        self.owed = {i: u.grad_written or i in self.grads for i, u in enumerate(self.swap.units)}
        # the next forward's first units are read now, while the caller gets its next batch
        for i in range(min(len(self.store.buffers), self.swap.config.param_prefetch + 1, len(self.owed))):
            if not self.read_ahead(self.swap.units[i]):
                break

    def idle(self) -> None:
        """Nothing owed (the forward has run every update; a backward is under way): unless resident,
        the buffers go back, so the backward's activations never meet them.  One allocation per
        step, not per unit."""
        if not self.owed and self.store.buffers and not self.resident:
            self.forget()
            self.store.buffers = []

    def owes(self, unit: Unit) -> bool:
        return self.index[id(unit)] in self.owed

    def reading(self, unit: Unit) -> bool:
        return self.index[id(unit)] in self.reads

    def held(self, unit: Unit) -> torch.Tensor | None:
        """The unit's current params (its file's bytes) if a buffer still holds them."""
        buf = self.holds.get(self.index[id(unit)])
        return None if buf is None else buf.f32["master"][:unit.numel]

    def grad_region(self, unit: Unit) -> tuple[torch.Tensor, bool] | None:
        """Where the unit's gradient goes instead of the grad file, resident: its buffer's grad
        region and whether that already holds this step's earlier micro-steps (to add into)."""
        i = self.index[id(unit)]
        if not self.resident or i not in self.holds or (unit.grad_written and i not in self.grads):
            return None
        assert i not in self.owed and i not in self.reads
        return self.holds[i].f32["grad"][:unit.numel], i in self.grads

    def keep_grad(self, unit: Unit) -> None:
        self.grads.add(self.index[id(unit)])

    def drop_grads(self) -> None:
        """The gradients the step did not take (a skipped step; zero_grad) are gone."""
        self.grads &= set(self.owed)

    def read_ahead(self, unit: Unit) -> bool:
        i = self.index[id(unit)]
        return i in self.reads or (self.overlap and self._issue(i, wait=False))

    def _free(self, *, wait: bool) -> _Buffer | None:
        buf = self._idle(wait=wait)
        if buf is not None:
            self.holds = {i: b for i, b in self.holds.items() if b is not buf}
        return buf

    def _idle(self, *, wait: bool) -> _Buffer | None:
        busy = {id(b) for b, _ in self.writes} | {id(b) for b, _ in self.reads.values()}
        kept = {id(self.holds[i]) for i in self.grads}  # a gradient lives there: never reused
        held = {id(b) for b in self.holds.values()}
        for b in self.store.buffers:  # one holding no params first, then the params updated first
            if id(b) not in busy and id(b) not in held:
                return b
        for b in self.holds.values():
            if id(b) not in busy and id(b) not in kept:
                return b
        if self.writes and id(self.writes[0][0]) not in kept:
            freed = retire_write(self.writes, wait=wait)
            if freed is not None:
                return freed
        if wait:  # every buffer holds a read ahead: give up the one needed last
            i = max(i for i in self.reads if i not in self.holds)
            b, reqs = self.reads.pop(i)
            for r in reqs:
                r.wait()
            return b
        return None

    def _issue(self, i: int, *, wait: bool) -> bool:
        unit = self.swap.units[i]
        buf = self.holds.get(i)
        keys: tuple[str, ...] = ()  # a held unit's state is in its buffer already
        if buf is None:
            buf = self._free(wait=wait)
            if buf is None:
                return False
            keys = STATES
        if self.owed[i] and i not in self.grads:
            keys += ("grad",)
        elif not self.owed[i]:
            buf.f32["grad"][:unit.numel].zero_()  # no gradient reached this unit that step
        self.reads[i] = (buf, self.store._io(unit, buf, keys, write=False))
        return True

    def _settle(self, buf: _Buffer) -> None:
        """Wait for the buffer's write-backs (a held unit's last update) before it is rewritten."""
        mine = [w for w in self.writes if w[0] is buf]
        for w in mine:
            self.writes.remove(w)
            for r in w[1]:
                r.wait()

    def apply(self, unit: Unit, *, land: bool) -> None:
        """Update the unit (reading it first if no read ahead did), start its write-back, and with
        ``land`` refill its shards with the updated params."""
        i = self.index[id(unit)]
        if i not in self.reads:
            self._issue(i, wait=True)
        buf, reqs = self.reads.pop(i)
        for r in reqs:
            r.wait()
        self._settle(buf)
        self.store.update(unit, buf, **self.args)
        del self.owed[i]
        self.grads.discard(i)
        if land:
            self.swap.fill(unit, buf.f32["master"][:unit.numel])
        self.holds.pop(i, None)
        self.holds[i] = buf  # the most recently updated last
        self.writes.append((buf, self.store._io(unit, buf, STATES, write=True)))
        if not self.overlap:
            self.drain()

    def run_all(self) -> None:
        """Every owed update, now, without landing (before the files are read or a new step)."""
        order = sorted(self.owed)
        ahead = max(1, len(self.store.buffers) - 2)
        for k, i in enumerate(order):
            for j in order[k + 1:k + 1 + ahead]:
                if not self.read_ahead(self.swap.units[j]):
                    break
            self.apply(self.swap.units[i], land=False)
        self.drain()

    def drop(self) -> None:
        self.forget()
        self.owed = {}

    def forget(self) -> None:
        """No request in flight and the buffers' contents given up (the caller may overwrite or
        free them): a gradient still in a buffer goes to the grad file first."""
        self.drain()
        for i in sorted(self.grads):
            unit = self.swap.units[i]
            for r in self.store._io(unit, self.holds[i], ("grad",), write=True):
                r.wait()
            unit.grad_written = True
        self.grads.clear()
        self.holds.clear()

    def drain(self) -> None:
        """Wait for every request in flight (reads of owed units are simply issued again later;
        held buffers keep what they hold)."""
        pending = [r for _, reqs in list(self.writes) + list(self.reads.values()) for r in reqs]
        self.writes.clear()
        self.reads.clear()
        error: OSError | None = None
        for r in pending:  # all of them, even after an error: no request may outlive its buffer
            try:
                r.wait()
            except OSError as e:
                error = error or e
        if error is not None:
            raise error


def map_file(path: str):
    """``region(offset, numel)``: ``numel`` fp32 elements of ``path`` from byte ``offset``, in a storage of
    exactly that size, over one copy-on-write mapping of the file (a load writes into private pages, never
    the file; one descriptor per file however many tensors)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        whole = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)

    def region(offset: int, numel: int) -> torch.Tensor:
        if numel == 0:
            return torch.zeros(0, dtype=torch.float32)
        return torch.frombuffer(whole, dtype=torch.float32, count=numel, offset=offset)

    return region
