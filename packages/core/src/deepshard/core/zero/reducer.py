"""Gradient reduction launched from post-accumulate-grad hooks, so it overlaps backward.

``AllReduceReducer`` (stage 0) leaves every rank the averaged full gradient in fp32 flat bucket
buffers.  ``FullGradScatterReducer`` (stage 1) accumulates the same full buffers but reduce-scatters
them at the accumulation boundary: each rank gets only its Shard(0) rows averaged.
``ReduceScatterReducer`` (stage 2) leaves every rank only the averaged Shard(0) chunk of each
gradient, reduced every micro-step and accumulated in fp32, and frees the full gradient as soon as
its bucket is packed: the whole gradient is never held at once.

Gradients accumulate in fp32 whatever the compute dtype (a bf16 sum of many micro-batches loses
the small ones); the wire dtype is ``reduce_dtype`` (DeepSpeed's ``communication_data_type``).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from deepshard.core.dtensor_utils import like_param, local_grad, local_tensor
from deepshard.core.zero.collectives import exchange_with_peer, pairwise_reduce_scatter
from deepshard.core.zero.handoff import GradHandoff
from deepshard.core.zero.layout import BucketLayout, group_into_buckets, local_shard


class _HookedReducer:
    """Buckets of parameters in backward order; a bucket launches when all its grads are ready."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, reduce_bucket_size: int,
                 overlap: bool, reduce_dtype: torch.dtype = torch.float32) -> None:
        self.params = params
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.overlap = overlap
        order = list(reversed(range(len(params))))  # backward visits the last layers first
        locals_ = [local_tensor(p.data) for p in params]
        groups = group_into_buckets([locals_[i].numel() for i in order],
                                    [locals_[i].dtype for i in order], reduce_bucket_size)
        self.buckets = [[order[j] for j in g] for g in groups]
        self.bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self.layouts = [BucketLayout(idx, [locals_[i].shape for i in idx], self.world) for idx in self.buckets]
        self.sync = True
        self._ready = [0] * len(self.buckets)
        self._launched = [False] * len(self.buckets)
        self._pending: list[tuple[int, torch.Tensor, dist.Work | None]] = []
        # the hooks hold the reducer weakly: a param -> hook -> reducer -> params cycle through a
        # tensor's hook dict is never collected (a dropped engine kept its whole model state alive)
        ref = weakref.ref(self)

        def on_grad(p: torch.Tensor) -> None:
            reducer = ref()
            if reducer is not None:
                reducer._on_grad(p)

        self._handles = [p.register_post_accumulate_grad_hook(on_grad) for p in params]
        self._index = {id(p): i for i, p in enumerate(params)}

    def _on_grad(self, p: torch.Tensor) -> None:
        self._accumulate(self._index[id(p)])
        if not self.sync:
            return
        b = self.bucket_of[self._index[id(p)]]
        self._ready[b] += 1
        if self._ready[b] == len(self.buckets[b]):
            self._ready[b] = 0  # a bucket may fill again (several backward passes, e.g. pipeline micro-batches)
            self._launch(b)

    @property
    def num_launched(self) -> int:
        """Buckets whose collective has been launched in the current backward (overlap, observable)."""
        return sum(self._launched)

    def _grad_or_zeros(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return local_grad(p) if p.grad is not None else torch.zeros_like(local_tensor(p.data))

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

    def _accumulate(self, i: int) -> None:  # noqa: B027 - the reduce-scatter accumulates after reducing
        """Fold a freshly accumulated ``params[i].grad`` into the fp32 accumulator, where there is one."""

    def _launch(self, b: int) -> None:
        raise NotImplementedError

    def _complete(self, b: int, buf: torch.Tensor) -> None:
        raise NotImplementedError


class AllReduceReducer(_HookedReducer):
    """DDP semantics: average the full gradient over the group, in buckets of fp32 flat buffers.

    fp32 params keep their gradients as views of the buffers (DDP's ``gradient_as_bucket_view``):
    after each step's first gradient is copied in, autograd accumulates into them in place, with no
    packing copy and no copy back.  bf16/fp16
    params cannot hold an fp32 ``.grad``: each micro-step's gradient is folded into its fp32 view
    by the post-accumulate hook and dropped, so the accumulation is fp32 too.
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, reduce_bucket_size: int,
                 overlap: bool, reduce_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(params, group, reduce_bucket_size=reduce_bucket_size, overlap=overlap,
                         reduce_dtype=reduce_dtype)
        self.flats: list[torch.Tensor] = []
        self.offsets: dict[int, int] = {}  # param index -> element offset in its bucket's flat buffer
        for idx in self.buckets:
            offset = 0
            for i in idx:
                self.offsets[i] = offset
                offset += local_tensor(self.params[i].data).numel()
            first = local_tensor(self.params[idx[0]].data)
            self.flats.append(torch.zeros(offset, dtype=torch.float32, device=first.device))
        self.as_views = [local_tensor(p.data).dtype == torch.float32 for p in params]
        self.zero_grad()

    def grad(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s fp32 gradient: a view of its bucket."""
        local = local_tensor(self.params[i].data)
        flat = self.flats[self.bucket_of[i]]
        return flat[self.offsets[i]:self.offsets[i] + local.numel()].view(local.shape)

    def grad_bytes(self) -> int:
        return sum(flat.nbytes for flat in self.flats)

    def zero_grad(self) -> None:
        """Forget the step's gradients without a pass over the buckets: each param's first gradient of
        the next step is copied into its view (:meth:`_home`), and a view no gradient reached is
        zeroed when its bucket launches.  (Zeroing 17M fp32 elements took 12 ms a step here.)"""
        for p in self.params:
            p.grad = None

    def _home(self, i: int) -> None:
        """Point ``params[i].grad`` at its bucket view, copying in a gradient held elsewhere: the step's
        first, which autograd allocated (it adds the later ones in place), or one somebody replaced."""
        p = self.params[i]
        view = self.grad(i)
        if local_tensor(p.grad).data_ptr() != view.data_ptr():
            view.copy_(local_grad(p))
            p.grad = like_param(p, view)

    def _accumulate(self, i: int) -> None:
        p = self.params[i]
        if p.grad is None:
            return
        if self.as_views[i]:
            self._home(i)
        else:
            self.grad(i).add_(local_grad(p))
            p.grad = None

    def _gather_home(self, b: int) -> None:
        """Make bucket ``b``'s flat buffer hold every one of its gradients before it is reduced."""
        self._launched[b] = True
        for i in self.buckets[b]:
            p = self.params[i]
            if self.as_views[i] and p.grad is None:  # no gradient reached it this step
                view = self.grad(i)
                view.zero_()
                p.grad = like_param(p, view)
            else:
                self._accumulate(i)

    def _launch(self, b: int) -> None:
        self._gather_home(b)
        flat = self.flats[b]
        wire = flat if self.reduce_dtype == flat.dtype else flat.to(self.reduce_dtype)
        work = dist.all_reduce(wire, group=self.group, async_op=self.overlap)
        self._pending.append((b, wire, work if self.overlap else None))

    def _complete(self, b: int, buf: torch.Tensor) -> None:
        flat = self.flats[b]
        if buf is not flat:
            flat.copy_(buf)
        flat.div_(self.world)


class _PackedReducer(_HookedReducer):
    """Reductions that pack each bucket's Shard(0) chunks rank-major (``zero/layout.py``) into a reusable
    ``world x segment`` buffer (the largest bucket: about ``reduce_bucket_size``); at most ``num_buffers``
    are in flight, and when none is free the oldest reduction is completed first (its buffer comes back).
    At world 2 on gloo the reduce-scatter is one send/recv exchange (3x faster, zero/collectives.py).
    ``keep_buffers=False`` frees the buffers once backward's reductions are done: they are then held
    in the boundary backward only, like its activations, not between steps."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, reduce_bucket_size: int,
                 overlap: bool, reduce_dtype: torch.dtype = torch.float32, num_buffers: int = 1,
                 keep_buffers: bool = True) -> None:
        super().__init__(params, group, reduce_bucket_size=reduce_bucket_size, overlap=overlap,
                         reduce_dtype=reduce_dtype)
        self.num_buffers, self.keep_buffers = num_buffers, keep_buffers
        self.pairwise = pairwise_reduce_scatter(group)
        self._free: list[torch.Tensor] = []
        self._in_use: dict[int, torch.Tensor] = {}

    def _buffer(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A packing buffer big enough for any bucket; completes the oldest reduction when none is free."""
        while not self._free and len(self._in_use) >= self.num_buffers and self._pending:
            self._complete_oldest()
        for k, flat in enumerate(self._free):
            if flat.dtype == dtype:
                del self._free[k]
                return flat
        size = max(layout.segment for layout in self.layouts)
        return torch.empty(self.world * size, dtype=dtype, device=device)

    def _reduce_scatter(self, b: int, grads: list[torch.Tensor]) -> torch.Tensor:
        """Launch bucket ``b``'s reduce-scatter of ``grads`` (its full gradients, in bucket order); returns
        the ``segment`` where this rank's chunks land.  Pairwise, that is the peer's part alone: this
        rank's own part never leaves it, and ``_complete`` adds it."""
        while b in self._in_use:  # refilled (the next pipeline micro-batch) before its last reduction landed:
            self._complete_oldest()  # land that first, its buffer is not overwritten (a LoRA stage: one bucket)
        self._launched[b] = True
        seg = self.layouts[b].segment
        flat_all = self._buffer(self.reduce_dtype, grads[0].device)
        flat = flat_all[:self.world * seg]
        if self.pairwise:  # send the peer its chunks, receive the peer's part of ours
            send, out = flat[:seg], flat[seg:]
            self.layouts[b].pack_rank(grads, send, 1 - self.rank)
            work = exchange_with_peer(send, out, self.group)
            if not self.overlap:
                work.wait()
        else:
            self.layouts[b].pack_full(grads, flat)
            out = flat[self.rank * seg:(self.rank + 1) * seg]  # in place: this rank's segment
            work = dist.reduce_scatter_single(out, flat, group=self.group, async_op=self.overlap)
        self._in_use[b] = flat_all
        self._pending.append((b, out, work if self.overlap else None))
        return out

    def _complete_oldest(self) -> None:
        b, buf, work = self._pending.pop(0)
        if work is not None:
            work.wait()
        self._complete(b, buf)
        self._free.append(self._in_use.pop(b))

    def finish(self) -> None:
        super().finish()
        self._free.extend(self._in_use.values())
        self._in_use.clear()
        if not self.keep_buffers:
            self._free.clear()

    def pool_bytes(self) -> int:
        """Bytes of the reusable packing buffers (reduced in place)."""
        return sum(t.nbytes for t in self._free + list(self._in_use.values()))

    def _owns(self, t: torch.Tensor) -> bool:
        """Whether this rank's own part of ``t`` is in its Shard(0) chunk: a 0-d tensor is rank 0's chunk
        (``shard_rows`` of one row), so on another rank it is not."""
        return t.dim() > 0 or self.rank == 0


class FullGradScatterReducer(AllReduceReducer, _PackedReducer):
    """ZeRO-1 as DeepSpeed's stage 1 does it: full gradients accumulate in the fp32 buckets exactly as
    with :class:`AllReduceReducer` (no packing while ``sync`` is off), and at the accumulation boundary
    each bucket is reduce-scattered, not all-reduced: each rank updates only its Shard(0) chunk, so it
    needs only that chunk averaged, and a reduce-scatter moves half an all-reduce's bytes (gloo at
    world 2: 35 ms for 17M fp32 elements against the all-reduce's 69 ms).

    After the boundary backward, each ``p.grad`` holds the average over ranks in this rank's Shard(0)
    rows and this rank's own gradient elsewhere.  The packing buffers are held in that backward only.
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, reduce_bucket_size: int,
                 overlap: bool, reduce_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(params, group, reduce_bucket_size=reduce_bucket_size, overlap=overlap,
                         reduce_dtype=reduce_dtype)
        self.keep_buffers = False

    def _launch(self, b: int) -> None:
        self._gather_home(b)
        self._reduce_scatter(b, [self.grad(i) for i in self.buckets[b]])

    def _complete(self, b: int, buf: torch.Tensor) -> None:
        owns = [local_shard(self.grad(i), self.world, self.rank) for i in self.buckets[b]]
        for own, arrived in zip(owns, self.layouts[b].local_views(buf, owns)):
            if self.pairwise and self._owns(own):
                own.add_(arrived)  # the peer's part; a + b == b + a, so the sum is the all-reduce's
            else:
                own.copy_(arrived)
            own.div_(self.world)


class ReduceScatterReducer(_PackedReducer):
    """ZeRO-2: each rank keeps the averaged Shard(0) chunk of every gradient, nothing more.

    Packing goes through one reusable buffer of ``world x segment`` elements (the largest bucket:
    about ``reduce_bucket_size``), reduce-scattered in place (this rank's result lands in its own
    segment of the buffer), so the model state is the ZeRO formula plus one bucket.  Bucket k is
    completed (waited for, folded into the fp32 shard accumulators) when bucket k+1 is ready to
    pack: its reduction overlaps the backward of bucket k+1's layers.  ``num_buffers=2`` keeps two
    buffers in flight (DeepSpeed's double ``ipg`` buffers), for links slower than one bucket's backward.
    """

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, reduce_bucket_size: int,
                 overlap: bool, reduce_dtype: torch.dtype = torch.float32, num_buffers: int = 1,
                 handoff: GradHandoff | None = None) -> None:
        super().__init__(params, group, reduce_bucket_size=reduce_bucket_size, overlap=overlap,
                         reduce_dtype=reduce_dtype, num_buffers=num_buffers)
        self.shard_grads: list[torch.Tensor | None] = [None] * len(params)
        # on the accumulation boundary (``final``), each averaged shard is handed over as it lands
        self.handoff = handoff
        self.final = True

    def _launch(self, b: int) -> None:
        idx = self.buckets[b]
        grads = [self._grad_or_zeros(i) for i in idx]
        self._reduce_scatter(b, grads)
        if self.pairwise:  # fold our own part in now, while the peer's is on the wire
            for i, g in zip(idx, grads):
                if self._owns(g):
                    self._fold(i, local_shard(g, self.world, self.rank))
        for i in idx:  # the full gradient is gone as soon as it is packed
            self.params[i].grad = None

    def _complete(self, b: int, buf: torch.Tensor) -> None:
        idx = self.buckets[b]
        chunks = [local_shard(local_tensor(self.params[i].data), self.world, self.rank) for i in idx]
        for i, view in zip(idx, self.layouts[b].local_views(buf, chunks)):
            self._fold(i, view)
            if self.final and self.handoff is not None:
                self.handoff(i, self.shard_grads[i])

    def _fold(self, i: int, grad: torch.Tensor) -> None:
        """Add ``grad / world`` (a sum over ranks, or one rank's part of it) into shard ``i``'s fp32 accumulator."""
        if self.shard_grads[i] is None:
            self.shard_grads[i] = grad.to(torch.float32, copy=True).div_(self.world)
        else:
            self.shard_grads[i].add_(grad, alpha=1.0 / self.world)

    def shard_grad(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s averaged fp32 Shard(0) gradient (zeros where backward left none)."""
        g = self.shard_grads[i]
        if g is None:
            shard = local_shard(local_tensor(self.params[i].data), self.world, self.rank)
            g = torch.zeros(shard.shape, dtype=torch.float32, device=shard.device)
        return g

    def grad_bytes(self) -> int:
        shards = sum(g.nbytes for g in self.shard_grads if g is not None)
        return shards + sum(local_tensor(p.grad).nbytes for p in self.params if p.grad is not None)

    def zero_grad(self) -> None:
        self.shard_grads = [None] * len(self.params)
        for p in self.params:
            p.grad = None
        if self.handoff is not None:
            self.handoff.clear()
