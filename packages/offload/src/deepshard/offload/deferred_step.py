"""The deferred AdamW update of ZeRO-Infinity, piece by piece (see :mod:`.infinity_store`).

A unit's update is owed from ``step()`` until the unit is next needed (its unshard in the next
forward).  It runs in *pieces* of at most ``sub_group_size`` elements of the unit's flat layout
(DeepSpeed's ZeRO-Infinity sub-groups): each piece's param, moments and gradient are read into
one of ``buffer_count`` buffers of 16 bytes per piece element, updated, landed into the unit's
shard storages and written back, so the step's buffers are bounded by the piece size, never by
the largest unit (pieces and their I/O: :mod:`.pieces`).  The store gives this class its
collaborators (the swap, the pieces, the buffer pool and the update itself), not itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from .aio import AioRequest
from .pieces import Piece, PieceBuffers, piece_io
from .state_buffer import StateBuffer
from .streaming import retire_write
from .unit_swap import Unit, UnitSwap

Update = Callable[..., None]  # update(piece, buffer, *, lr, step, grad_scale): AdamW on the piece in place


class DeferredStep:
    """The updates a step still owes, each unit's run at its next use (see the module docstring).

    ``owed`` maps a piece's index to whether the step had a gradient for it (read from the grad
    file unless its buffer holds it); ``reads`` are read-aheads in flight into a buffer, ``writes``
    the write-backs of updated pieces (their buffer is free once they finish); ``holds`` the
    buffers that still hold a piece's current param and moments (those of its file, until reused),
    least recently updated first: the backward right after the forward, which needs the last
    units first, refills a unit from there when every piece of it is held instead of reading the
    param file again, and the next update of a held piece reads no state.  ``grads``: pieces whose
    gradient (this step's sum so far) is in their held buffer instead of the grad file.

    When the buffers outnumber the pieces (``buffer_count >= pieces``: *resident*, a model small
    enough that its 16 B/elt fit in the buffers the forward holds anyway) they are kept for the
    whole run: every piece stays held, its gradient goes to its buffer, and a step reads nothing
    and writes each piece's param and moments once (12 B/elt, behind the forward).  Otherwise they
    are freed at the backward's first gradient, so the backward's activations never meet them."""

    def __init__(self, *, swap: UnitSwap, pieces: list[Piece], pool: PieceBuffers, update: Update) -> None:
        self.swap = swap
        self.pieces = pieces
        self.pool = pool
        self.update = update
        self.index = {id(u): i for i, u in enumerate(self.swap.units)}
        self.of_unit: list[list[int]] = [[] for _ in self.swap.units]
        for k, p in enumerate(self.pieces):
            self.of_unit[p.unit].append(k)
        self.resident = pool.count >= len(self.pieces)
        self.owed: dict[int, bool] = {}
        self.args: dict[str, float] = {}
        self.reads: dict[int, tuple[StateBuffer, list[AioRequest]]] = {}
        self.writes: deque[tuple[StateBuffer, list[AioRequest]]] = deque()
        self.holds: dict[int, StateBuffer] = {}
        self.grads: set[int] = set()
        self.overlap = self.swap.config.aio.overlap_events  # False: no read ahead, writes waited for

    def _io(self, piece: Piece, buf: StateBuffer, keys: tuple[str, ...], *, write: bool) -> list[AioRequest]:
        return piece_io(self.swap, piece, buf, keys, write=write)

    def _pieces(self, unit: Unit) -> list[int]:
        return self.of_unit[self.index[id(unit)]]

    def start(self, *, lr: float, step: int, grad_scale: float) -> None:
        assert not self.owed and not self.reads
        self.pool.ensure()
        self.args = {"lr": lr, "step": step, "grad_scale": grad_scale}
        units = self.swap.units
        self.owed = {k: units[p.unit].grad_written or k in self.grads for k, p in enumerate(self.pieces)}
        # the next forward's first pieces are read now, while the caller gets its next batch
        first = [k for k, p in enumerate(self.pieces) if p.unit <= self.swap.config.param_prefetch]
        for k in first[:len(self.pool.buffers)]:
            if not self._read_piece(k):
                break

    def idle(self) -> None:
        """Nothing owed (the forward has run every update; a backward is under way): unless resident,
        the buffers go back, so the backward's activations never meet them.  One allocation per
        step, not per piece."""
        if not self.owed and self.pool.buffers and not self.resident:
            self.forget()
            self.pool.free()

    def owes(self, unit: Unit) -> bool:
        return any(k in self.owed for k in self._pieces(unit))

    def reading(self, unit: Unit) -> bool:
        ks = self._pieces(unit)
        return bool(ks) and ks[0] in self.reads

    def held(self, unit: Unit) -> list[tuple[int, torch.Tensor]] | None:
        """The unit's current params (its file's bytes), piece by piece (first element, values),
        if buffers still hold every piece of it."""
        ks = self._pieces(unit)
        if not all(k in self.holds for k in ks):
            return None
        return [(self.pieces[k].start, self.holds[k].f32["master"][:self.pieces[k].numel]) for k in ks]

    def grad_region(self, unit: Unit) -> tuple[list[tuple[int, torch.Tensor]], bool] | None:
        """Where the unit's gradient goes instead of the grad file, resident: its pieces' grad
        regions (first element, region) and whether they already hold this step's earlier
        micro-steps (to add into)."""
        ks = self._pieces(unit)
        if not self.resident or not all(k in self.holds for k in ks):
            return None
        if unit.grad_written and not all(k in self.grads for k in ks):
            return None
        assert not any(k in self.owed or k in self.reads for k in ks)
        regions = [(self.pieces[k].start, self.holds[k].f32["grad"][:self.pieces[k].numel]) for k in ks]
        return regions, bool(ks) and ks[0] in self.grads

    def keep_grad(self, unit: Unit) -> None:
        self.grads.update(self._pieces(unit))

    def drop_grads(self) -> None:
        """The gradients the step did not take (a skipped step; zero_grad) are gone."""
        self.grads &= set(self.owed)

    def read_ahead(self, unit: Unit) -> bool:
        """Start reading the unit's owed pieces into free buffers; False once none is free."""
        return all(self._read_piece(k) for k in self._pieces(unit) if k in self.owed)

    def _read_piece(self, k: int) -> bool:
        return k in self.reads or (self.overlap and self._issue(k, wait=False))

    def _free(self, *, wait: bool) -> StateBuffer | None:
        buf = self._idle(wait=wait)
        if buf is not None:
            self.holds = {i: b for i, b in self.holds.items() if b is not buf}
        return buf

    def _idle(self, *, wait: bool) -> StateBuffer | None:
        busy = {id(b) for b, _ in self.writes} | {id(b) for b, _ in self.reads.values()}
        kept = {id(self.holds[i]) for i in self.grads}  # a gradient lives there: never reused
        held = {id(b) for b in self.holds.values()}
        for b in self.pool.buffers:  # one holding no params first, then the params updated first
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

    def _issue(self, k: int, *, wait: bool) -> bool:
        piece = self.pieces[k]
        buf = self.holds.get(k)
        keys: tuple[str, ...] = ()  # a held piece's state is in its buffer already
        if buf is None:
            buf = self._free(wait=wait)
            if buf is None:
                return False
            keys = ("param", "exp_avg", "exp_avg_sq")
        if self.owed[k] and k not in self.grads:
            keys += ("grad",)
        elif not self.owed[k]:
            buf.f32["grad"][:piece.numel].zero_()  # no gradient reached this unit that step
        self.reads[k] = (buf, self._io(piece, buf, keys, write=False))
        return True

    def _settle(self, buf: StateBuffer) -> None:
        """Wait for the buffer's write-backs (a held piece's last update) before it is rewritten."""
        mine = [w for w in self.writes if w[0] is buf]
        for w in mine:
            self.writes.remove(w)
            for r in w[1]:
                r.wait()

    def apply(self, unit: Unit, *, land: bool) -> None:
        """Update the unit piece by piece (reading each first if no read ahead did), start each
        piece's write-back, and with ``land`` refill the unit's shards with the updated params."""
        for k in self._pieces(unit):
            self._apply_piece(k, land=land)
        if land:
            unit.resident = True

    def _apply_piece(self, k: int, *, land: bool) -> None:
        piece = self.pieces[k]
        if k not in self.reads:
            self._issue(k, wait=True)
        ahead = max(1, len(self.pool.buffers) - 2)
        for j in [j for j in sorted(self.owed) if j > k][:ahead]:  # the next pieces read behind this one
            if not self._read_piece(j):
                break
        buf, reqs = self.reads.pop(k)
        for r in reqs:
            r.wait()
        self._settle(buf)
        self.update(piece, buf, **self.args)
        del self.owed[k]
        self.grads.discard(k)
        if land:
            self.swap.fill_range(self.swap.units[piece.unit], piece.start, buf.f32["master"][:piece.numel])
        self.holds.pop(k, None)
        self.holds[k] = buf  # the most recently updated last
        self.writes.append((buf, self._io(piece, buf, ("param", "exp_avg", "exp_avg_sq"), write=True)))
        if not self.overlap:
            self.drain()

    def flush_writes(self) -> None:
        """Wait for every write-back in flight (before the param file is read directly)."""
        while self.writes:
            retire_write(self.writes, wait=True)

    def run_all(self) -> None:
        """Every owed update, now, without landing (before the files are read or a new step)."""
        for k in sorted(self.owed):
            self._apply_piece(k, land=False)
        self.drain()

    def drop(self) -> None:
        self.forget()
        self.owed = {}

    def forget(self) -> None:
        """No request in flight and the buffers' contents given up (the caller may overwrite or
        free them): a gradient still in a buffer goes to the grad file first."""
        self.drain()
        for k in sorted(self.grads):
            for r in self._io(self.pieces[k], self.holds[k], ("grad",), write=True):
                r.wait()
            self.swap.units[self.pieces[k].unit].grad_written = True
        self.grads.clear()
        self.holds.clear()

    def drain(self) -> None:
        """Wait for every request in flight (reads of owed pieces are simply issued again later;
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
