"""Optimizer state on NVMe: ZeRO-Infinity's swap, streamed through a small pool of host buffers.

Layout: the params are concatenated (each starting at a multiple of 16 elements) into one flat
element space that is cut into sub-groups of ``sub_group_size`` elements (rounded down to a
multiple of 16; the last group shorter).  A param that crosses a boundary is split
across groups; the update rule must be elementwise (AdamW is), so where a group boundary falls never
changes the math, and every group -- hence every buffer -- is bounded by ``sub_group_size``.  Each
state (the master and the rule's states: AdamW's exp_avg, exp_avg_sq) has its own preallocated swap
file holding group ``g`` at ``g * stride`` (stride = the largest group's bytes rounded up to 4096, as O_DIRECT needs).

The step streams groups through ``buffer_count`` page-aligned buffers: while group g is stepped
on the CPU, group g+1 (and more, with more buffers) is being read and group g-1 written back by
the aio threads.  Gradients are copied (cast to fp32) into a group's buffer when the buffer is
assigned to it and the new masters are cast back into the params right after its update, so no
full-size host copy of either ever exists.

With CUDA params both copies are asynchronous on a side stream into/out of pinned buffers: the
device->host gradient copies of the groups read ahead run while the CPU steps the current group
(an event per buffer says when they landed), and the host->device copy of the new weights (cast to
the compute dtype on the host into the buffer's dead gradient region, so it is a same-dtype DMA)
runs while the next group is stepped; a buffer is reused only after its copies are done, and the
compute stream waits for the side stream before the step returns.  Without CUDA the same code
runs with plain synchronous copies.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch

from deepshard.core.state_store import StateStore
from deepshard.core.update_rule import UpdateRule

from . import scratch
from .aio import AioEngine, AioRequest, SwapFile, align_up
from .config import OffloadConfig, validate_nvme
from .state_buffer import VEC, StateBuffer
from .streaming import stream_groups

Segment = tuple[int, int, int, int]  # (param index, offset in param, offset in group, length)


def _segments(numels: list[int], group_size: int) -> list[list[Segment]]:
    """Cut the concatenation of params into groups of ``group_size`` elements (params may split).

    Params start at multiples of ``VEC`` and groups hold a multiple of ``VEC`` elements, so every
    piece of a split param starts at a param offset that is a multiple of ``VEC``: torch's fused
    CPU AdamW splits its work in 16-element units from each tensor's start, so each element gets
    the same (vector or scalar-tail) arithmetic as in one whole-tensor update: bitwise parity.
    """
    align = VEC if group_size >= VEC else 1  # tiny groups: no padding (a gap could skip a group)
    group_size -= group_size % align
    groups: list[list[Segment]] = []
    pos = 0  # position in the padded flat space
    for i, n in enumerate(numels):
        if n == 0:
            continue
        pos = -(-pos // align) * align
        offset = 0
        while offset < n:
            g, go = divmod(pos, group_size)
            while len(groups) <= g:
                groups.append([])
            k = min(group_size - go, n - offset)
            groups[g].append((i, offset, go, k))
            offset += k
            pos += k
    return groups


class NvmeStateStore(StateStore):
    """fp32 master + the rule's states in per-rank swap files (one per state) under ``config.nvme_path``."""

    def __init__(self, params: list[torch.Tensor], weight_decays: list[float], rule: UpdateRule, *,
                 config: OffloadConfig, rank: int = 0, run_id: str | None = None,
                 masters: list[torch.Tensor] | None = None) -> None:
        super().__init__(params, weight_decays, rule)
        self.keys = ("master", *rule.states)  # one swap file and one buffer region each
        self._initial = params if masters is None else masters  # what the swap files start from
        for i, p in enumerate(params):
            assert p.is_contiguous(), f"param {i} is not contiguous: the store updates it through a flat view"
        self.config = config
        self.numel = sum(p.numel() for p in params)
        self.groups = _segments([p.numel() for p in params], config.sub_group_size)
        self.group_numels = [g[-1][2] + g[-1][3] for g in self.groups]  # incl. alignment gaps
        self.largest = max(self.group_numels, default=0)
        self.stride = align_up(self.largest * 4)
        file_bytes = max(len(self.groups) * self.stride, 1)
        validate_nvme(config, len(self.keys) * file_bytes, self.largest)
        self.dir = scratch.make_store_dir(config.nvme_path, run_id or f"pid{os.getpid()}", rank)
        self.files: dict[str, SwapFile] = {}
        self.engine: AioEngine | None = None
        cuda = [p for p in params if p.is_cuda]
        self._copy_stream = torch.cuda.Stream(cuda[0].device) if cuda else None
        low = {p.dtype for p in params} - {torch.float32}
        assert len(low) <= 1, f"one compute dtype per store, got {low}"
        try:
            for k in self.keys:
                self.files[k] = SwapFile(str(self.dir / f"{k}.swp"), file_bytes)
            self.direct = all(f.direct for f in self.files.values())
            self.engine = AioEngine(config.aio)
            pin = torch.cuda.is_available()
            num_buffers = min(config.buffer_count, max(len(self.groups), 1))
            self._buffers = [StateBuffer(self.largest, pin, self.keys) for _ in range(num_buffers)]
            self._stream(self._fill_initial, read=False, write=True)
            del self._initial
        except BaseException:
            self.close()
            raise

    # -- the pipeline -------------------------------------------------------------------------

    def _io(self, g: int, buf: StateBuffer, *, write: bool) -> list[AioRequest]:
        assert self.engine is not None
        nbytes = align_up(self.group_numels[g] * 4)
        op = self.engine.write if write else self.engine.read
        return [op(self.files[k].fd, buf.mv[k][:nbytes], g * self.stride) for k in self.keys]

    def _stream(self, fn: Callable[[int, StateBuffer], None], *, read: bool, write: bool,
                assign: Callable[[int, StateBuffer], None] | None = None) -> None:
        """Run ``fn(g, buffer)`` for every group in order, with reads ahead and writes behind
        (:func:`~deepshard.offload.streaming.stream_groups`).  ``assign(g, buffer)`` runs when a
        buffer is handed to group g (with the read ahead): where the step starts its gradient copies.
        """
        stream_groups(len(self.groups), self._buffers, fn,
                      read_io=(lambda g, b: self._io(g, b, write=False)) if read else None,
                      write_io=(lambda g, b: self._io(g, b, write=True)) if write else None,
                      overlap=self.config.aio.overlap_events,
                      before_reuse=lambda b: b.wait_copies(),  # its previous group's device copies are done
                      assign=assign)

    # -- per-group work -------------------------------------------------------------------------

    def _fill_initial(self, g: int, buf: StateBuffer) -> None:
        for pi, po, go, k in self.groups[g]:
            buf.f32["master"][go:go + k].copy_(self._initial[pi].detach().reshape(-1)[po:po + k])
        n = self.group_numels[g]
        for k in self.rule.states:
            buf.f32[k][:n].zero_()

    def _on_side(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else contextlib.nullcontext()

    def _record(self) -> torch.cuda.Event | None:
        if self._copy_stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        return event

    @contextlib.contextmanager
    def _device_copies(self) -> Iterator[None]:
        """Side stream after the compute stream on entry; compute stream after it on exit."""
        side = self._copy_stream
        if side is None:
            yield
            return
        compute = torch.cuda.current_stream(side.device)
        side.wait_stream(compute)  # grads are computed, params no longer read
        try:
            yield
        except BaseException:
            side.synchronize()  # nothing in flight may read grads or buffers being freed
            raise
        compute.wait_stream(side)  # the next forward sees the new weights (no host wait)

    def _to_params(self, g: int, buf: StateBuffer) -> None:
        """New masters -> params: cast on the host into the buffer's dead grad region, then copy
        (asynchronously on CUDA: a same-dtype copy from pinned memory is a plain DMA)."""
        with torch.no_grad():
            for pi, po, go, k in self.groups[g]:
                p = self.params[pi]
                src = buf.f32["master"][go:go + k]
                if p.dtype != torch.float32:
                    stage = buf.staging(p.dtype)[go:go + k]
                    stage.copy_(src)
                    src = stage
                with self._on_side():
                    p.view(-1)[po:po + k].copy_(src, non_blocking=p.is_cuda)
        buf.uploaded = self._record()

    def step(self, grads: list[torch.Tensor], *, lr: float, step: int, grad_scale: float = 1.0) -> None:
        flat = [g.detach().reshape(-1) for g in grads]

        def fetch_grads(g: int, buf: StateBuffer) -> None:
            """Device->host (cast to fp32) of group g's grads, in flight while earlier groups step."""
            gbuf = buf.f32["grad"]
            with self._on_side():
                for pi, po, go, k in self.groups[g]:
                    gbuf[go:go + k].copy_(flat[pi][po:po + k], non_blocking=flat[pi].is_cuda)
            buf.grads_landed = self._record()

        def update(g: int, buf: StateBuffer) -> None:
            segs = self.groups[g]
            buf.wait_grads()
            views = {key: [buf.f32[key][go:go + k] for _, _, go, k in segs] for key in (*self.keys, "grad")}
            self.rule.apply(views["master"], views["grad"], {k: views[k] for k in self.rule.states},
                            [self.weight_decays[s[0]] for s in segs], lr=lr, step=step, grad_scale=grad_scale)
            self._to_params(g, buf)

        with self._device_copies():
            self._stream(update, read=True, write=True, assign=fetch_grads)

    # -- checkpoints ----------------------------------------------------------------------------

    # deepshard.core.checkpoint.request.FRESH_STATE_DICT: state_dict's tensors are fresh reads, kept by
    # no one, so an asynchronous save adopts them instead of staging a second copy
    state_dict_is_fresh = True

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        """Reads the swap files back into fresh fp32 tensors (checkpoints never point at scratch)."""
        out = {k: [torch.empty(p.shape, dtype=torch.float32) for p in self.params] for k in self.keys}

        def gather(g: int, buf: StateBuffer) -> None:
            for pi, po, go, k in self.groups[g]:
                for key in self.keys:
                    out[key][pi].view(-1)[po:po + k].copy_(buf.f32[key][go:go + k])

        self._stream(gather, read=True, write=False)
        return out

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        for key in self.keys:
            assert len(state[key]) == len(self.params), f"{key}: {len(state[key])} tensors for {len(self.params)} params"
        flat = {key: [t.detach().reshape(-1) for t in state[key]] for key in self.keys}

        def scatter(g: int, buf: StateBuffer) -> None:
            for pi, po, go, k in self.groups[g]:
                for key in self.keys:
                    buf.f32[key][go:go + k].copy_(flat[key][pi][po:po + k])
            self._to_params(g, buf)

        with self._device_copies():
            self._stream(scatter, read=False, write=True)

    def state_bytes(self) -> dict[str, int]:
        """NVMe holds the state; host counts the staging buffers' state regions."""
        host = sum(b.state_bytes for b in getattr(self, "_buffers", []))
        return {"device": 0, "host": host, "nvme": len(self.keys) * 4 * self.numel}

    def io_stats(self) -> dict[str, float]:
        """Bytes moved and busy seconds per direction since the last :meth:`reset_io_stats`."""
        assert self.engine is not None
        e = self.engine
        return {"read_bytes": e.bytes[False], "write_bytes": e.bytes[True],
                "read_busy_s": e.busy_s[False], "write_busy_s": e.busy_s[True]}

    def reset_io_stats(self) -> None:
        if self.engine is not None:
            self.engine.reset_stats()

    def close(self) -> None:
        """Stop the I/O threads, close and delete the swap files (idempotent)."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        for f in self.files.values():
            f.close()
        self.files = {}
        for buf in getattr(self, "_buffers", []):
            buf.wait_copies()  # unpinning memory a copy still reads is undefined
        self._buffers = []
        if getattr(self, "dir", None) is not None:
            scratch.unregister(self.dir)
            scratch.remove_dir(self.dir)
            self.dir = None
