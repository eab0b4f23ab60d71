"""ZeRO 1-2 after the optimizer step: all-gather each rank's updated Shard(0) chunks back into the
replicated parameters, in buckets of ``zero.allgather_bucket_size`` elements.

One reusable buffer of ``world x segment`` elements (the largest bucket) serves every bucket: this
rank packs its chunks into its own segment and the all-gather runs in place, so the gather costs one
bucket of memory.  Two ways to run it:

- ``gather()`` (the plain path): every bucket, right after the step.
- ``start()`` + forward pre-hooks (``zero.overlap_allgather``): the step launches bucket 0 only; the
  forward pre-hook of a unit whose parameters sit in buckets up to k waits for them, writes them into
  the params and launches bucket k+1, which so travels while the unit computes (FSDP's and
  DeepSpeed's prefetch, applied to stages 1-2).  The units are FSDP2's: each transformer block, and
  the root with every parameter outside the blocks (a root's forward may read a child's weight
  directly, as a fused loss reads ``lm_head.weight``), gathered in that order: the root's first.
  Every parameter is current when a unit computes;
  ``finish()`` completes the rest (the engine calls it before the next optimizer step, from
  ``state_dict()`` and from ``Engine.gather_params()``: a direct read of a parameter's values between
  ``step()`` and the next forward must call that first).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from deepshard.core.zero.collectives import Works, all_gather_in_place
from deepshard.core.zero.layout import BucketLayout, group_into_buckets, local_shard

__all__ = ["ShardGatherer"]


class ShardGatherer:
    """All-gather each rank's updated Shard(0) chunks back into the replicated params, in buckets."""

    def __init__(self, params: list[torch.Tensor], group: dist.ProcessGroup, *, allgather_bucket_size: int,
                 order: list[int] | None = None) -> None:
        """``order``: the indices of ``params`` in gather order (default: as given)."""
        self.params = params
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        order = list(range(len(params))) if order is None else order
        assert sorted(order) == list(range(len(params)))
        groups = group_into_buckets([params[i].numel() for i in order], [params[i].dtype for i in order],
                                    allgather_bucket_size)
        self.buckets = [([order[j] for j in g], BucketLayout([order[j] for j in g],
                                                             [params[order[j]].shape for j in g], self.world))
                        for g in groups]
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._next = len(self.buckets)  # the next bucket to launch
        self._inflight: tuple[int, Works, torch.Tensor] | None = None
        self.num_waits_in_forward = 0  # buckets completed by a forward pre-hook (overlap, observable)

    def _buffer(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, device)
        if key not in self._buffers:
            seg = max(layout.segment for _, layout in self.buckets)
            self._buffers[key] = torch.empty(self.world * seg, dtype=dtype, device=device)
        return self._buffers[key]

    def _launch_next(self) -> None:
        if self._next >= len(self.buckets):
            return
        k = self._next
        self._next += 1
        idx, layout = self.buckets[k]
        first = self.params[idx[0]]
        seg = layout.segment
        buf = self._buffer(first.dtype, first.device)[:self.world * seg]
        send = buf[self.rank * seg:(self.rank + 1) * seg]
        layout.pack_local([local_shard(self.params[i], self.world, self.rank) for i in idx], send)
        self._inflight = (k, all_gather_in_place(buf, self.rank, self.world, self.group), buf)

    def start(self) -> None:
        """Launch bucket 0 of a new gather (after the step: the local shards are updated)."""
        assert self._inflight is None and self._next == len(self.buckets), "the previous gather is unfinished"
        self._next = 0
        self._launch_next()

    def ensure(self, bucket: int) -> None:
        """Buckets up to ``bucket`` written into the params; the next one launched (prefetch)."""
        while self._inflight is not None and self._inflight[0] <= bucket:
            k, work, buf = self._inflight
            self._inflight = None
            work.wait()
            idx, layout = self.buckets[k]
            # this rank's own chunks are the params' own slices, already current (and written by a
            # checkpoint load that came before this gather finished: its stale copy must not land)
            layout.unpack_full(buf, [self.params[i] for i in idx], skip_rank=self.rank)
            self._launch_next()

    def finish(self) -> None:
        """Every bucket of the current gather written into the params (no-op when none is running)."""
        self.ensure(len(self.buckets))

    def gather(self) -> None:
        """The plain path: all buckets now."""
        self.start()
        self.finish()

    def hook_forward(self, model: nn.Module, units: list[tuple[nn.Module, list[int]]]) -> None:
        """``overlap_allgather``: each unit's forward pre-hook completes the buckets holding its params
        (indices into ``params``) before it computes; ``model.state_dict()`` completes the whole gather."""
        bucket_of = {i: b for b, (idx, _) in enumerate(self.buckets) for i in idx}
        ref = weakref.ref(self)  # weakly: a module -> hook -> gatherer -> params cycle would never be freed
        for module, indices in units:
            if indices:
                module.register_forward_pre_hook(_ForwardWait(ref, max(bucket_of[i] for i in indices)))
        model.register_state_dict_pre_hook(_StateDictWait(ref))

    def buffer_bytes(self) -> int:
        """Bytes of the reusable gather buffer (allocated on the first gather)."""
        return sum(t.nbytes for t in self._buffers.values())


class _ForwardWait:
    def __init__(self, ref: weakref.ref, bucket: int) -> None:
        self.ref, self.bucket = ref, bucket

    def __call__(self, module: nn.Module, args: tuple) -> None:
        gatherer = self.ref()
        if gatherer is not None and gatherer._inflight is not None and gatherer._inflight[0] <= self.bucket:
            gatherer.num_waits_in_forward += 1
            gatherer.ensure(self.bucket)


class _StateDictWait:
    def __init__(self, ref: weakref.ref) -> None:
        self.ref = ref

    def __call__(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        gatherer = self.ref()
        if gatherer is not None:
            gatherer.finish()


def forward_units(model: nn.Module, params: list[nn.Parameter],
                  blocks: list[nn.Module]) -> tuple[list[int], list[tuple[nn.Module, list[int]]]]:
    """(gather order, units): the root's params (all outside ``blocks``) first, then each block's."""
    index = {id(p): i for i, p in enumerate(params)}
    in_blocks: set[int] = set()
    units: list[tuple[nn.Module, list[int]]] = []
    for block in blocks:
        idx = sorted({index[id(p)] for p in block.parameters() if id(p) in index} - in_blocks)
        in_blocks.update(idx)
        units.append((block, idx))
    units.insert(0, (model, [i for i in range(len(params)) if i not in in_blocks]))
    return [i for _, idx in units for i in idx], units
