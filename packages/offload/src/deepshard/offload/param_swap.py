"""Parameters on NVMe (ZeRO-Infinity): each FSDP2 unit's shards live in a swap file between uses.

A *unit* is one ``fully_shard`` group (a transformer block, or the root's embeddings, final norm
and head).  This module decides *when* a unit moves: :class:`ParamSwap` hooks FSDP2 and moves
units through the files and buffer pool of :class:`~.unit_swap.UnitSwap`.  A unit's shards are
freed once its all-gather has copied them out and refilled right before its next all-gather,
read ``param_prefetch`` units ahead of use: forward order in forward, reverse order in backward,
on the same :class:`~deepshard.offload.aio.AioEngine` as the optimizer swap.

Hooks: three methods of each unit's ``FSDPParamGroup`` are wrapped on the instance (never the
class, :mod:`.fsdp_hooks`): ``unshard`` (refill first, then read ahead), ``wait_for_unshard`` (after it, the
unsharded params hold the data: free the shards) and ``post_backward`` (after the reduce-scatter,
the unit's gradient shards go to the gradient swap file, accumulated there across micro-steps,
and ``.grad`` is dropped, so no whole-model gradient is ever resident; when the optimizer's
buffers hold every unit (resident), into the unit's buffer instead of the file).  Each gradient's norm is
taken when it is written, so the optimizer's global norm needs no gradient in memory
(:meth:`ParamSwap.grad_norms`).  The optimizer step itself (:mod:`.infinity_store`) runs unit by
unit on the same files, each unit's update deferred to its unshard in the next forward (a
:class:`~.units.Deferred`): each shard is read once and written once per step, behind the
forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from .config import OffloadConfig
from .fsdp_hooks import (
    drop_grad,
    foreach_norm,
    hook_group,
    in_backward,
    is_sharded,
    is_unit,
    is_unsharded,
    param_group,
    take_local_grad,
)
from .grad_norms import GradNorms
from .param_init import fixed_mmap_threshold, unit_by_unit
from .tiled_shard import TiledShard
from .unit_swap import UnitSwap
from .units import Unit


def _units_in_order(model: nn.Module, blocks: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The FSDP units in forward order: the root, then units of their own that come before the
    blocks (a tiled embedding), the blocks, and those after them (a tiled head)."""
    inner = {id(b) for b in blocks} | {id(model)}
    before, after, seen_block = [], [], False
    for name, module in model.named_modules():
        if id(module) in inner:
            seen_block = seen_block or module is not model
            continue
        if any(m is module for m in blocks) or not is_unit(module):
            continue
        (after if seen_block else before).append((name, module))
    return [("root", model), *before, *[(f"block{i}", b) for i, b in enumerate(blocks)], *after]


def _slot_parts(regions: list[tuple[int, torch.Tensor]], offset: int, numel: int) -> list[torch.Tensor]:
    """Views of elements ``offset ... offset + numel`` of a unit's flat layout, in order, where the
    layout is held in ``regions`` (first element, flat fp32) that tile it."""
    parts = []
    for start, f32 in regions:
        lo, hi = max(offset, start), min(offset + numel, start + f32.numel())
        if lo < hi:
            parts.append(f32[lo - start:hi - start])
    if not parts:
        parts.append(regions[0][1][:0] if regions else torch.zeros(0))
    return parts


class ParamSwap(UnitSwap):
    """The FSDP hooks over a :class:`UnitSwap`: refills and read-aheads at unshard, frees after
    the all-gather, gradients to the grad file (with their norms) after the reduce-scatter."""

    def __init__(self, config: OffloadConfig, *, rank: int = 0, run_id: str | None = None) -> None:
        super().__init__(config, rank=rank, run_id=run_id)
        self.num_params = 0
        self.norms = GradNorms()
        self.tiled_shards: list[TiledShard] = []

    # -- wiring ---------------------------------------------------------------------------------

    def attach(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """Hook the FSDP units of ``model`` (after ``fully_shard``): the root first, then ``blocks``
        in forward order.  Params may still be on the meta device; the files open in :meth:`open`."""
        fixed_mmap_threshold()
        for name, module in _units_in_order(model, blocks):
            group = param_group(module)
            if group is None:
                continue
            unit = Unit(name, group)
            self.units.append(unit)
            hook_group(group, before_unshard=functools.partial(self._before_unshard, unit),
                       after_unshard=functools.partial(self._after_unshard, unit),
                       after_post_backward=functools.partial(self._after_post_backward, unit))
            if getattr(module, "vocab_tiling", None) is not None:  # read in rows, never all-gathered
                unit.tiled = True
                module.shard_io = TiledShard(swap=self, unit=unit, norms=self.norms)
                self.tiled_shards.append(module.shard_io)
        for p in model.parameters():
            if not p.requires_grad:
                raise ValueError("offload.params='nvme' does not support frozen parameters yet (+peft=lora): "
                                 "use offload.params=cpu or none")

    def open(self, params: list[torch.Tensor]) -> None:
        """Bind the store's tensors (each a local shard; their order is the optimizer's) to the slots.

        Without :meth:`materializer` the shards are laid out and written to the file here."""
        if self.engine is None:
            self.layout()
            try:
                for unit in self.units:
                    self.flush(unit, release=False)
            except BaseException:
                self.close()
                raise
        for i, p in enumerate(params):
            found = self.slot_of(p)
            assert found is not None, f"param {i} of the optimizer is not a swapped shard"
            found[1].index = i
        assert sorted(s.index for u in self.units for s in u.slots) == list(range(len(params)))
        self.num_params = len(params)
        self.norms.reset(len(params))

    def materializer(self, init_fn: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
        """Wrap a sharded model's ``materialize(model)`` so no more than a unit or two is ever
        initialized in memory (:func:`.param_init.unit_by_unit`)."""
        return unit_by_unit(self, init_fn)

    # -- FSDP hooks -----------------------------------------------------------------------------

    def _before_unshard(self, unit: Unit) -> None:
        if self.engine is None or not is_sharded(unit.group):
            return  # not opened yet (a forward before the store exists), or nothing to gather
        self.ensure(unit)
        order = self.units[::-1] if in_backward(unit.group) else self.units
        k = order.index(unit)
        for nxt in order[k + 1:k + 1 + self.config.param_prefetch]:
            if not is_sharded(nxt.group):
                continue
            if self.owed(nxt):
                assert self.deferred is not None
                if not self.deferred.read_ahead(nxt):
                    break
            elif not self.read_ahead(nxt, wait=False):
                break

    def _after_unshard(self, unit: Unit) -> None:
        if self.engine is not None and is_unsharded(unit.group):
            self.release(unit)  # the all-gather output holds the data now

    def _after_post_backward(self, unit: Unit) -> None:
        """This unit's reduced gradient shards -> the gradient file (accumulated), then dropped."""
        if self.engine is None:
            return
        self.begin_grads(unit)
        grads = [take_local_grad(s.fsdp_param) for s in unit.slots]
        if all(g is None for g in grads):
            return
        # resident (every unit's state in the deferred step's buffers): the gradient stays in its buffer
        kept = self.deferred.grad_region(unit) if self.deferred is not None else None
        buf = None
        if kept is not None:
            regions, accumulate = kept
        else:
            buf = self.free_buffer(wait=True)
            assert buf is not None
            regions, accumulate = [(0, buf[:unit.nbytes].view(torch.float32))], unit.grad_written
            if accumulate:  # grad accumulation: FSDP2 would add into .grad; add into the file's
                self.io(unit, "grad", buf, write=False).wait()
        if not accumulate:
            for _, f32 in regions:
                f32.zero_()
        views = []
        with torch.no_grad():
            for s, g in zip(unit.slots, grads):
                parts = _slot_parts(regions, s.offset, s.local_numel)
                if g is not None:
                    flat, pos = g.reshape(-1), 0
                    for part in parts:
                        src = flat[pos:pos + part.numel()]
                        if accumulate:
                            part.add_(src)
                        else:
                            part.copy_(src)
                        pos += part.numel()
                views.append(parts[0] if len(parts) == 1 else torch.cat(parts))
            for s, n in zip(unit.slots, foreach_norm(views)):
                self.norms.record(s.index, n)
        if buf is None:
            assert self.deferred is not None
            self.deferred.keep_grad(unit)
        else:
            self.write_behind(buf, [self.io(unit, "grad", buf, write=True)])
            unit.grad_written = True
        for s in unit.slots:
            drop_grad(s.fsdp_param)

    # -- for the optimizer ----------------------------------------------------------------------

    def local_grads(self, params: list[nn.Parameter]) -> list[torch.Tensor]:
        """Core's ``ParamOffload``: the optimizer's gradients of ``params`` (store order), which are
        in the grad file: their norms stand in (:meth:`grad_norms`)."""
        assert len(params) == self.num_params, f"{len(params)} params, the swap holds {self.num_params}"
        return self.grad_norms()

    def param_bytes(self, params: list[nn.Parameter]) -> int:
        """Core's ``ParamOffload``: the shards in memory right now (the rest are in the param file)."""
        return self.resident_bytes()

    def grad_norms(self) -> list[torch.Tensor]:
        """One 1-element fp32 tensor per param (store order): the 2-norm of its local gradient
        shard, taken when written.  Their squares sum to the squared norm of all local gradients,
        so the optimizer's global-norm all-reduce and clipping see the same value as with
        resident gradients (``||[n]|| = n`` exactly)."""
        return self.norms.values()

    def zero_grad(self) -> None:
        """The step consumed (or skipped) the gradients: the next backward starts a fresh sum."""
        self.finish_writes()
        if self.deferred is not None:
            self.deferred.drop_grads()
        for unit in self.units:
            unit.grad_written = False
        self.norms.reset(self.num_params)
