"""Whole FSDP units between their swap files and memory: the layout, the buffer pool, the refills.

:class:`UnitSwap` is the I/O half of ZeRO-Infinity's parameter swap, apart from the FSDP hooks
(:mod:`.param_swap`) that decide *when* a unit is needed.  It places every unit in the per-rank
files, keeps a small pool of page-aligned buffers (O_DIRECT), reads a unit ahead into a buffer,
lands it in the unit's FSDPParam shard storages, and frees those storages again
(``untyped_storage().resize_(0)``, FSDP2's own way of freeing unsharded params).  A unit whose
optimizer update is still owed (a :class:`Deferred`, :mod:`.infinity_store`) is refilled by the
update itself, or from the update's buffer while that still holds it.  Its public methods are
what the hooks (:mod:`.param_swap`), the sharded init (:mod:`.param_init`), a tiled unit's rows
(:mod:`.tiled_shard`) and the deferred step (:mod:`.pieces`) call; none of them reaches inside.

File layout (one set per rank, all four files alike): unit ``u`` at byte ``unit.offset``; inside
it each FSDPParam's padded flat shard at a multiple of 16 elements; fp32 throughout (stage 3's
sharded params are the fp32 masters).
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Iterator

import torch

from . import scratch
from .aio import AioEngine, AioRequest, SwapFile, aligned_empty, as_buffer
from .config import OffloadConfig, validate_param_swap
from .fsdp_hooks import group_params, local_numel, preserve_version, shard_data, storage_key
from .streaming import retire_write
from .units import FILES, Deferred, Slot, Unit, slot_offsets


class UnitSwap:
    """Owns the per-rank swap files of params, grads and Adam moments, and the buffer pool through
    which units are flushed to and refilled from them."""

    def __init__(self, config: OffloadConfig, *, rank: int = 0, run_id: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.run_id = run_id or f"pid{os.getpid()}"
        self.units: list[Unit] = []
        self.files: dict[str, SwapFile] = {}
        self.engine: AioEngine | None = None
        self.dir = None
        self._pool: list[torch.Tensor] = []
        self._writes: deque[tuple[torch.Tensor, list[AioRequest]]] = deque()
        self._by_storage: dict[int, tuple[Unit, Slot]] = {}
        self.reads: dict[str, int] = {}
        self.reset_io_stats()
        self.deferred: Deferred | None = None  # the optimizer's update still owed to some units

    def layout(self) -> None:
        """Place the (materialized, maybe still untouched) shards; check space and buffers; create
        the files (fresh: unwritten preallocated blocks read as zeros, the moments' initial value)."""
        offset = 0
        for unit in self.units:
            fps = group_params(unit.group)
            for fp in fps:
                data = shard_data(fp)
                assert data.dtype == torch.float32, f"{fp}: sharded params must be fp32 masters, got {data.dtype}"
                assert data.storage_offset() == 0 and data.untyped_storage().nbytes() == data.numel() * 4, \
                    f"{fp}: the shard does not own its storage; it cannot be swapped"
            starts, unit.numel = slot_offsets(shard_data(fp).numel() for fp in fps)
            unit.slots.extend(Slot(fp, start, shard_data(fp).numel(), local_numel(fp), -1)
                              for fp, start in zip(fps, starts))
            unit.offset = offset
            offset += unit.nbytes
        self._by_storage = {storage_key(s.data): (u, s) for u in self.units for s in u.slots}
        # the pool holds gathered units whole; a tiled unit goes through it in pool-sized chunks
        largest = max((u for u in self.units if not u.tiled), key=lambda u: u.numel)
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

    def flush(self, unit: Unit, *, release: bool) -> None:
        """The unit's shards -> the param file (through a pool buffer); then free them if ``release``."""
        buf = self.free_buffer(wait=True)
        assert buf is not None
        for lo, hi in self._chunks(unit, buf):
            f32 = buf[:hi - lo].view(torch.float32)
            f32.zero_()
            first = lo // 4
            for s in unit.slots:
                a, b = max(first, s.offset), min(first + f32.numel(), s.offset + s.numel)
                if a < b:
                    f32[a - first:b - first].copy_(s.data[a - s.offset:b - s.offset])
            self.io(unit, "param", buf, write=True, span=(lo, hi)).wait()
        if release:
            self.release(unit, force=True)

    # -- I/O helpers ----------------------------------------------------------------------------

    def io(self, unit: Unit, key: str, buf: torch.Tensor, *, write: bool,
           span: tuple[int, int] | None = None) -> AioRequest:
        """The unit's bytes (or ``span``: bytes ``lo ... hi`` of it) between ``buf`` and a file."""
        assert self.engine is not None
        lo, hi = span if span is not None else (0, unit.nbytes)
        view = as_buffer(buf[:hi - lo])
        op = self.engine.write if write else self.engine.read
        return op(self.files[key].fd, view, unit.offset + lo)

    def write_behind(self, buf: torch.Tensor, requests: list[AioRequest]) -> None:
        """A write out of pool buffer ``buf`` in flight: the buffer is reused once it is done."""
        self._writes.append((buf, requests))

    @staticmethod
    def _chunks(unit: Unit, buf: torch.Tensor) -> list[tuple[int, int]]:
        """The unit's bytes in ranges that fit ``buf`` (one range for a unit the pool holds whole)."""
        step = buf.numel() - buf.numel() % 4096
        return [(lo, min(lo + step, unit.nbytes)) for lo in range(0, unit.nbytes, step)]

    def free_buffer(self, *, wait: bool) -> torch.Tensor | None:
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

    def _held(self, unit: Unit) -> list[tuple[int, torch.Tensor]] | None:
        return None if self.deferred is None else self.deferred.held(unit)

    def read_ahead(self, unit: Unit, *, wait: bool) -> bool:
        if unit.resident or unit.pending is not None or self._held(unit) is not None or unit.tiled:
            return True  # (a tiled unit is read in rows by its op, or in chunks by ensure)
        buf = self.free_buffer(wait=wait)
        if buf is None:
            return False
        unit.pending = (buf, [self.io(unit, "param", buf, write=False)])
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
                with preserve_version(data):
                    data.copy_(f32[s.offset:s.offset + s.numel])
        unit.resident = True

    def fill_range(self, unit: Unit, start: int, f32: torch.Tensor) -> None:
        """Refill the part of the unit's shard storages that elements ``start ...`` of its flat
        layout cover from ``f32`` (a piece of the deferred update); the caller marks the unit
        resident once every piece has landed."""
        end = start + f32.numel()
        with torch.no_grad():
            for s in unit.slots:
                lo, hi = max(start, s.offset), min(end, s.offset + s.numel)
                if lo >= hi:
                    continue
                data = s.data
                if data.untyped_storage().nbytes() != s.numel * 4:
                    data.untyped_storage().resize_(s.numel * 4)
                with preserve_version(data):
                    data[lo - s.offset:hi - s.offset].copy_(f32[lo - start:hi - start])

    def slot_of(self, t: torch.Tensor) -> tuple[Unit, Slot] | None:
        """The unit and slot whose shard storage ``t`` views (after :meth:`layout`), or None."""
        return self._by_storage.get(storage_key(t))

    def owed(self, unit: Unit) -> bool:
        """Whether the last step's update of the unit has not run yet (it runs at the unit's next use)."""
        return self.deferred is not None and self.deferred.owes(unit)

    def update_in_file(self, unit: Unit) -> None:
        """Run the owed update of the unit now, into its files (not landed in memory): before the
        param file is read directly (a tiled unit's rows)."""
        assert self.deferred is not None
        self.reads["demand"] += 1
        self.deferred.apply(unit, land=False)
        self.deferred.flush_writes()

    def begin_grads(self, unit: Unit) -> None:
        """A gradient of the unit is about to be written: the forward ran every owed update, so
        the step's buffers can go back (unless resident)."""
        assert not self.owed(unit), f"{unit.name}: a gradient reached a unit whose last update is still owed"
        if self.deferred is not None:
            self.deferred.idle()

    def ensure(self, unit: Unit) -> None:
        if unit.resident:
            return
        if self.owed(unit):  # the last step's update of this unit runs now, and lands its params
            assert self.deferred is not None
            self.reads["prefetched" if self.deferred.reading(unit) else "demand"] += 1
            self.deferred.apply(unit, land=True)
            return
        held = self._held(unit)
        if held is not None and unit.pending is None:  # the update's buffers still have them
            self.reads["kept"] += 1
            for start, f32 in held:
                self.fill_range(unit, start, f32)
            unit.resident = True
            return
        self.reads["prefetched" if unit.pending is not None else "demand"] += 1
        if unit.tiled:  # whole only for inspection (resident()): chunk by chunk through a pool buffer
            buf = self.free_buffer(wait=True)
            assert buf is not None
            for lo, hi in self._chunks(unit, buf):
                self.io(unit, "param", buf, write=False, span=(lo, hi)).wait()
                self.fill_range(unit, lo // 4, buf[:hi - lo].view(torch.float32))
            unit.resident = True
            return
        self.read_ahead(unit, wait=True)
        self._land(unit)

    def release(self, unit: Unit, *, force: bool = False) -> None:
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

    def finish_writes(self) -> None:
        while self._writes:
            _, reqs = self._writes.popleft()
            for r in reqs:
                r.wait()

    def release_all(self) -> None:
        """Drop every resident shard (before the step rewrites the param file)."""
        for unit in self.units:
            if unit.pending is not None:
                self._land(unit)
            self.release(unit, force=True)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """All shards in memory inside the block (inspection, small exports), released after."""
        for unit in self.units:
            self.ensure(unit)
        try:
            yield
        finally:
            self.release_all()

    def resident_bytes(self) -> int:
        return 4 * sum(s.numel for u in self.units if u.resident for s in u.slots)

    def pool_bytes(self) -> int:
        return sum(b.numel() for b in self._pool)

    def io_stats(self) -> dict[str, float]:
        assert self.engine is not None
        e = self.engine
        return {"read_bytes": e.bytes[False], "write_bytes": e.bytes[True],
                "read_busy_s": e.busy_s[False], "write_busy_s": e.busy_s[True], "io_busy_s": e.busy_s[None],
                **self.reads}

    def reset_io_stats(self) -> None:
        if self.engine is not None:
            self.engine.reset_stats()
        # unit refills: waited for at use / read ahead / from the deferred update's buffers
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
