"""The optimizer side of ZeRO-Infinity: AdamW unit by unit on the parameter swap's files.

With ``offload.params=nvme`` the sharded fp32 params *are* the master weights and live in the
param swap file (:mod:`.param_swap`), beside the gradient and both Adam moment files.  The step
streams units through ``buffer_count`` buffers of 16 bytes per element (param, exp_avg,
exp_avg_sq, grad): while unit u is updated, u+1 is read and u-1 written back, so each shard is
read once and written once per step and no model-sized host tensor ever exists.  The gradients
given to :meth:`step` are the swap's per-param norms (the real ones are in the grad file).
"""

from __future__ import annotations

import torch

from deepshard.core.state_store import AdamWConfig, StateStore, adamw_update

from .aio import AioRequest, as_buffer
from .nvme_store import _Buffer
from .param_swap import ParamSwap, Unit
from .streaming import stream_groups

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

    def _buffers(self) -> list[_Buffer]:
        largest = max(u.numel for u in self.swap.units)
        count = min(self.swap.config.buffer_count, len(self.swap.units))
        return [_Buffer(largest, torch.cuda.is_available()) for _ in range(count)]

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

    def _stream(self, fn, *, read_keys: tuple[str, ...], write_keys: tuple[str, ...]) -> None:
        units = self.swap.units

        def read_io(g: int, buf: _Buffer) -> list[AioRequest]:
            unit = units[g]
            keys = tuple(k for k in read_keys if k != "grad" or unit.grad_written)
            if "grad" in read_keys and not unit.grad_written:
                buf.f32["grad"][:unit.numel].zero_()  # no gradient reached this unit this step
            return self._io(unit, buf, keys, write=False)

        stream_groups(len(units), self._buffers(), fn,
                      read_io=read_io if read_keys else None,
                      write_io=(lambda g, b: self._io(units[g], b, write_keys, write=True)) if write_keys else None,
                      overlap=self.swap.config.aio.overlap_events)

    def step(self, grads: list[torch.Tensor], *, lr: float, step: int, grad_scale: float = 1.0) -> None:
        swap = self.swap
        swap.finish_writes()
        swap.release_all()  # resident copies would be stale after the update

        def update(g: int, buf: _Buffer) -> None:
            slots = swap.units[g].slots
            views = {k: [buf.f32[_REGION[k]][s.offset:s.offset + s.local_numel] for s in slots]
                     for k in STATES + ("grad",)}
            adamw_update(views["param"], views["grad"], views["exp_avg"], views["exp_avg_sq"],
                         [self.weight_decays[s.index] for s in slots], self.adamw, lr=lr, step=step,
                         grad_scale=grad_scale)

        self._stream(update, read_keys=STATES + ("grad",), write_keys=STATES)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        """Views of the swap files themselves (``master`` is the params), mapped, not read: a
        checkpoint save streams them from the page cache and no copy of the state is made.  The
        views are for the save (or a load) at hand: the next step rewrites the files."""
        self.swap.finish_writes()
        out: dict[str, list[torch.Tensor]] = {}
        for k in STATES:
            f = self.swap.files[k]
            whole = torch.from_file(f.path, shared=False, size=f.nbytes // 4, dtype=torch.float32)
            views: list[torch.Tensor] = [torch.empty(0)] * len(self.params)
            for unit in self.swap.units:
                base = unit.offset // 4
                for s in unit.slots:
                    views[s.index] = whole[base + s.offset:base + s.offset + s.local_numel].view(self.params[s.index].shape)
            out[_REGION[k]] = views
        return out

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Masters become the params (written to the param file), moments to theirs (a load into
        :meth:`state_dict`'s views lands in private copies of the mapped pages, copied here)."""
        self.swap.release_all()
        flat = {key: [t.detach().reshape(-1) for t in state[key]] for key in ("master", "exp_avg", "exp_avg_sq")}

        def scatter(g: int, buf: _Buffer) -> None:
            unit = self.swap.units[g]
            for k in STATES:
                region = buf.f32[_REGION[k]]
                region[:unit.numel].zero_()  # FSDP's padding stays zero
                for s in unit.slots:
                    region[s.offset:s.offset + s.local_numel].copy_(flat[_REGION[k]][s.index])

        self._stream(scatter, read_keys=(), write_keys=STATES)

    def state_bytes(self) -> dict[str, int]:
        return {"device": 0, "host": 0, "nvme": 12 * self.numel}

    def buffer_bytes(self) -> dict[str, int]:
        return {"param_swap_pool": self.swap.pool_bytes()}

    def io_stats(self) -> dict[str, float]:
        return self.swap.io_stats()

    def reset_io_stats(self) -> None:
        self.swap.reset_io_stats()

    def close(self) -> None:
        self.swap.close()


def _offset(buf: _Buffer, key: str) -> int:
    """Byte offset of a region in the buffer's raw allocation."""
    return buf.f32[key].data_ptr() - buf.raw.data_ptr()

