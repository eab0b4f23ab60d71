"""Gradient reduction launched from post-accumulate-grad hooks, so it overlaps backward.

``AllReduceReducer`` (stages 0 and 1) leaves every rank the averaged full gradient in ``p.grad``.
``ReduceScatterReducer`` (stage 2) leaves every rank only the averaged Shard(0) chunk of each
gradient, accumulated across micro-steps, and frees the full gradient as soon as its bucket is
packed: the whole gradient is never held at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from deepshard.core.zero.layout import BucketLayout, group_into_buckets, local_shard


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a DTensor (tensor parallel), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class _HookedReducer:
    """Buckets of parameters in backward order; a bucket launches when all its grads are ready."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, bucket_numel: int,
                 overlap: bool) -> None:
        self.params = params
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.overlap = overlap
        order = list(reversed(range(len(params))))  # backward visits the last layers first
        locals_ = [local_tensor(p.data) for p in params]
        groups = group_into_buckets([locals_[i].numel() for i in order],
                                    [locals_[i].dtype for i in order], bucket_numel)
        self.buckets = [[order[j] for j in g] for g in groups]
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self.layouts = [BucketLayout(idx, [locals_[i].shape for i in idx], self.world) for idx in self.buckets]
        self.sync = True
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)
        self._pending: list[tuple[int, torch.Tensor, dist.Work | None]] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._index = {id(p): i for i, p in enumerate(params)}

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.sync:
            return
        b = self.bucket_of[self._index[id(p)]]
        self._ready[b] += 1
        if self._ready[b] == len(self.buckets[b]):
            self._ready[b] = 0  # a bucket may fill again (several backward passes, e.g. pipeline micro-batches)
            self._launch(b)

    def _grad_or_zeros(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p.data))

    def finish(self) -> None:
        """Launch buckets whose params got no gradient, wait for all, and write results out."""
        if not self.sync:
            return
        for b in range(len(self.buckets)):
            if not self._launched[b] or self._ready[b]:  # never launched, or partly refilled
                self._launch(b)
        for b, buf, work in self._pending:
            if work is not None:
                work.wait()
            self._complete(b, buf)
        self._pending.clear()
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()

    def _launch(self, b: int) -> None:
        raise NotImplementedError

    def _complete(self, b: int, buf: torch.Tensor) -> None:
        raise NotImplementedError


class AllReduceReducer(_HookedReducer):
    """DDP semantics: average the full gradient over the group, in buckets."""

    def _launch(self, b: int) -> None:
        self._launched[b] = True
        grads = [self._grad_or_zeros(i) for i in self.buckets[b]]
        buf = torch.cat([g.reshape(-1) for g in grads])
        work = dist.all_reduce(buf, group=self.group, async_op=self.overlap)
        self._pending.append((b, buf, work if self.overlap else None))

    def _complete(self, b: int, buf: torch.Tensor) -> None:
        buf.div_(self.world)
        offset = 0
        for i in self.buckets[b]:
            p = self.params[i]
            local = local_tensor(p.data)
            g = buf[offset:offset + local.numel()].view(local.shape)
            offset += local.numel()
            if p.grad is None:
                p.grad = _like_param(p, g.clone())
            else:
                local_tensor(p.grad).copy_(g)


class ReduceScatterReducer(_HookedReducer):
    """ZeRO-2: each rank keeps the averaged Shard(0) chunk of every gradient, nothing more."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, bucket_numel: int,
                 overlap: bool, on_shard_ready=None) -> None:
        super().__init__(params, group, bucket_numel=bucket_numel, overlap=overlap)
        self.shard_grads: list[torch.Tensor | None] = [None] * len(params)
        self.on_shard_ready = on_shard_ready

    def _launch(self, b: int) -> None:
        self._launched[b] = True
        idx = self.buckets[b]
        layout = self.layouts[b]
        grads = [self._grad_or_zeros(i) for i in idx]
        flat = torch.empty(self.world * layout.segment, dtype=grads[0].dtype, device=grads[0].device)
        layout.pack_full(grads, flat)
        for i in idx:  # the full gradient is gone as soon as it is packed
            self.params[i].grad = None
        out = torch.empty(layout.segment, dtype=flat.dtype, device=flat.device)
        work = dist.reduce_scatter_single(out, flat, group=self.group, async_op=self.overlap)
        self._pending.append((b, out, work if self.overlap else None))

    def _complete(self, b: int, buf: torch.Tensor) -> None:
        buf.div_(self.world)
        idx = self.buckets[b]
        chunks = [local_shard(local_tensor(self.params[i].data), self.world, self.rank) for i in idx]
        for i, view in zip(idx, self.layouts[b].local_views(buf, chunks)):
            if self.shard_grads[i] is None:
                self.shard_grads[i] = view.clone()
            else:
                self.shard_grads[i].add_(view)

    def zero_grad(self) -> None:
        self.shard_grads = [None] * len(self.params)


def dtensor_replication(p: torch.Tensor) -> int:
    """Ranks holding an identical copy of ``p``'s local tensor on the mesh ``p`` lives on (1 if plain)."""
    if not hasattr(p, "placements"):
        return 1
    n = 1
    for size, placement in zip(p.device_mesh.shape, p.placements):
        if placement.is_replicate():
            n *= size
    return n


def _like_param(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Wrap a local gradient as a DTensor when the param is one (tensor parallel)."""
    if hasattr(p, "to_local"):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return g
