"""The optimizer side of ZeRO-Infinity: AdamW unit by unit on the parameter swap's files.

With ``offload.params=nvme`` the sharded fp32 params *are* the master weights and live in the
param swap file (:mod:`.param_swap`), beside the gradient and both Adam moment files.  The update
streams each unit in pieces of at most ``min(sub_group_size, buffer_size)`` elements through ``buffer_count``
buffers of 16 bytes per piece element (param, exp_avg, exp_avg_sq, grad), allocated once per
step: each shard is read once and written once per step, no model-sized host tensor ever exists,
and the buffers follow the piece size, not the largest unit.  The gradients given to
:meth:`step` are the swap's per-param norms (the real ones are in the grad file).

The update is *deferred* (:class:`~.deferred_step.DeferredStep`): :meth:`InfinityStore.step`
only records lr, step and gradient scale and starts reading the first pieces; each unit is then
updated when it is next needed, at its unshard in the next forward, in forward order, while the
read of the next pieces and the write-back of the previous ones are in flight behind the
forward's compute.  The updated params land straight in the unit's shards, piece by piece, so
the forward reads no param file of its own.  The arithmetic is the store's update rule on
the same elements (pieces start 16-aligned in every shard), so the result is bit-identical to an
eager step; anything that reads the files (a checkpoint save, :meth:`ParamSwap.resident`) first
runs the updates still owed.  With as many buffers as pieces (*resident*) the buffers keep every
piece's state and gradient between steps: a step then reads nothing and writes 12 bytes per
element.
"""

from __future__ import annotations

import mmap
import os

import torch

from deepshard.core.state_store import StateStore
from deepshard.core.update_rule import UpdateRule

from .deferred_step import DeferredStep
from .param_swap import ParamSwap
from .pieces import REGION, Piece, PieceBuffers, cut_pieces, piece_io, piece_size
from .state_buffer import StateBuffer
from .streaming import stream_groups

STATES = ("param", "exp_avg", "exp_avg_sq")
RULE_STATES = ("exp_avg", "exp_avg_sq")  # the swap's state files (units.FILES): AdamW's moments


class InfinityStore(StateStore):
    """AdamW state (and the params themselves) in the :class:`ParamSwap`'s files."""

    defers_update = True  # each unit's update runs at its next use (the divergence check's norm: below)

    def __init__(self, params: list[torch.Tensor], weight_decays: list[float], rule: UpdateRule, *,
                 swap: ParamSwap) -> None:
        # the swap creates its files when the params are materialized, before any rule exists: a rule
        # with other states needs the swap to take its state names first (a later issue)
        if tuple(rule.states) != RULE_STATES:
            raise ValueError(f"offload.params=nvme keeps the states {RULE_STATES} in its swap files; "
                             f"the update rule {type(rule).__name__} has {tuple(rule.states)}")
        super().__init__(params, weight_decays, rule)
        self.swap = swap
        swap.open(params)
        self.numel = sum(p.numel() for p in params)
        self.piece_numel = piece_size(min(swap.config.sub_group_size, swap.config.buffer_size), swap.units)
        self.pieces: list[Piece] = cut_pieces(swap.units, self.piece_numel)
        self.pool = PieceBuffers(piece_numel=self.piece_numel,
                                 count=min(swap.config.buffer_count, len(self.pieces)))
        self.deferred = DeferredStep(swap=swap, pieces=self.pieces, pool=self.pool, update=self.update)
        swap.deferred = self.deferred
        # each param's sum of squares as the deferred update leaves it, piece by piece (the norm costs no
        # read of its own); published in ``applied`` with the update's step once every piece has run
        self._sq = [0.0] * len(params)
        self._updated = 0
        self._step = 0
        self.applied: tuple[int, list[float]] | None = None

    def _write_all(self, fn) -> None:
        """``fn(piece, buffer)`` fills each piece's states in a buffer, written behind the next."""
        pieces = self.pieces
        self.deferred.forget()  # every buffer free, no request in flight
        self.pool.ensure()
        stream_groups(len(pieces), self.pool.buffers, lambda g, b: fn(pieces[g], b), read_io=None,
                      write_io=lambda g, b: piece_io(self.swap, pieces[g], b, STATES, write=True),
                      overlap=self.swap.config.aio.overlap_events)

    def step(self, grads: list[torch.Tensor], *, lr: float, step: int, grad_scale: float = 1.0) -> None:
        """Record the update; each unit's runs at its next use (:class:`DeferredStep`)."""
        swap = self.swap
        swap.finish_writes()
        self.deferred.run_all()  # two steps with no forward between: the first one's updates first
        swap.release_all()  # resident copies would be stale after the update
        self._sq, self._updated, self._step = [0.0] * len(self.params), 0, step
        self.deferred.start(lr=lr, step=step, grad_scale=grad_scale)

    def update(self, piece: Piece, buf: StateBuffer, *, lr: float, step: int, grad_scale: float) -> None:
        """The rule's update of one piece whose param, states and gradient are in ``buf``: on each
        shard's elements in it (its FSDP padding untouched), with that shard's weight decay."""
        cuts = _cuts(self.swap.units[piece.unit], piece)
        views = {k: [buf.f32[REGION[k]][lo:hi] for _, lo, hi in cuts] for k in STATES + ("grad",)}
        self.rule.apply(views["param"], views["grad"], {k: views[k] for k in RULE_STATES},
                        [self.weight_decays[s.index] for s, _, _ in cuts], lr=lr, step=step, grad_scale=grad_scale)
        for (s, _, _), v in zip(cuts, views["param"], strict=True):
            self._sq[s.index] += float(v.dot(v))
        self._updated += 1
        if self._updated == len(self.pieces):
            self.applied = (step, self._sq)

    def applied_param_sq(self, *, settle: bool = False) -> tuple[int, list[float]] | None:
        """The sums of squares of the newest update applied in full (see :class:`StateStore`); ``settle``
        runs the owed update now (as a save would) or, with none applied since the params were made or
        loaded, reads them from the param file piece by piece."""
        if not settle:
            return self.applied
        self.swap.finish_writes()
        self.deferred.run_all()
        if self.applied is not None and self.applied[0] == self._step:
            return self.applied
        sq = [0.0] * len(self.params)

        def add(piece: Piece, buf: StateBuffer) -> None:
            for s, lo, hi in _cuts(self.swap.units[piece.unit], piece):
                v = buf.f32["master"][lo:hi]
                sq[s.index] += float(v.dot(v))

        pieces = self.pieces
        self.deferred.forget()  # every buffer free, no request in flight
        self.pool.ensure()
        stream_groups(len(pieces), self.pool.buffers, lambda g, b: add(pieces[g], b),
                      read_io=lambda g, b: piece_io(self.swap, pieces[g], b, ("param",), write=False), write_io=None,
                      overlap=self.swap.config.aio.overlap_events)
        return self._step, sq

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
            out[REGION[k]] = views
        return out

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Masters become the params (written to the param file), moments to theirs (a load into
        :meth:`state_dict`'s views lands in private copies of the mapped pages, copied here)."""
        self.deferred.drop()  # the loaded state replaces whatever update was still owed
        self.applied = None
        self.swap.release_all()
        flat = {key: [t.detach().reshape(-1) for t in state[key]] for key in ("master", "exp_avg", "exp_avg_sq")}

        def scatter(piece: Piece, buf: StateBuffer) -> None:
            cuts = _cuts(self.swap.units[piece.unit], piece)
            for k in STATES:
                region = buf.f32[REGION[k]]
                region[:piece.numel].zero_()  # FSDP's padding stays zero
                for s, lo, hi in cuts:
                    first = piece.start + lo - s.offset
                    region[lo:hi].copy_(flat[REGION[k]][s.index][first:first + hi - lo])

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


def _cuts(unit, piece: Piece) -> list[tuple]:
    """``(slot, lo, hi)``: the piece-relative range of each shard's elements (not its padding) in
    the piece."""
    out = []
    end = piece.start + piece.numel
    for s in unit.slots:
        lo, hi = max(piece.start, s.offset), min(end, s.offset + s.local_numel)
        if lo < hi:
            out.append((s, lo - piece.start, hi - piece.start))
    return out


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
