"""Where this rank's fp32 master weights and AdamW moments live, and where their update runs.

This is the seam between ZeRO and offload (docs/architecture.md): every ZeRO stage hands its optimizer
work to a ``StateStore``; :class:`DeviceStateStore` keeps the state beside the params, and the
offload package provides stores on pinned host memory and on NVMe.  Stage code never branches
on where the state lives.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.optim.adamw import adamw

try:  # optional (design.md: core -> kernels for fused AdamW); torch's fused kernel serves without it
    from deepshard.kernels.host_adam import host_adamw_runs_
except ImportError:  # pragma: no cover - kernels not installed
    host_adamw_runs_ = None

# a flat host run this long goes through the one-pass kernel when that saves a pass (see adamw_update);
# a compiled call costs ~0.1 ms more than torch's (dynamo's guards, measured at 1M elements, one thread),
# a quarter of the cast pass it saves at 1M elements: at 4M+ the saving clearly dominates
HOST_ADAM_MIN_NUMEL = 1 << 22


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyper-parameters that stay fixed for the run (lr comes per step from the schedule)."""

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0


class StateStore(ABC):
    """Owns the fp32 master copy and the AdamW moments of a list of local shards.

    ``params`` are the tensors the model computes with (this rank's shards: local tensors of
    DTensors, or slices of replicated params), in compute dtype, on the compute device.  After
    :meth:`step` they hold the updated values.  ``weight_decays`` holds one decay per param.
    """

    def __init__(self, params: list[torch.Tensor], weight_decays: list[float], adamw: AdamWConfig) -> None:
        assert len(params) == len(weight_decays)
        self.params = params
        self.weight_decays = weight_decays
        self.adamw = adamw

    @abstractmethod
    def step(self, grads: list[torch.Tensor], *, lr: float, step: int, grad_scale: float = 1.0) -> None:
        """Apply one AdamW update with ``grads * grad_scale`` and write the result into ``params``.

        ``step`` is the 1-based count of applied updates (for bias correction); ``grad_scale``
        folds loss-scale removal and clipping into the update so no store needs a grad copy.
        The grads are consumed: a store may overwrite them.
        """

    def grad_ready(self, index: int, grad: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Called when ``grads[index]`` is final for this step, while backward may still run.

        Stores that move gradients elsewhere (host memory) start the copy here so it overlaps
        backward; the default keeps the gradient where it is.
        """

    @abstractmethod
    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        """``{"master", "exp_avg", "exp_avg_sq"}``: one tensor per param, shaped like it, fp32."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Inverse of :meth:`state_dict`; also refreshes ``params`` from the loaded masters."""

    @abstractmethod
    def state_bytes(self) -> dict[str, int]:
        """Bytes of master + moments by residence: ``{"device": .., "host": .., "nvme": ..}``."""

    def buffer_bytes(self) -> dict[str, int]:
        """Named staging buffers the store holds beyond the state itself (none by default)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files and buffers (stores with scratch files remove them here)."""


class StoreFactory(Protocol):
    """What decides where optimizer state lives: a store class, or a function that builds one.

    ``masters`` (fp32, one per param, shaped like it) are the values the fp32 master weights start
    from, taken before the params were cast to a 16-bit compute dtype (``apply_mixed_precision``);
    None: the params themselves.  A store is built from them directly, never patched afterwards.
    """

    def __call__(self, params: list[torch.Tensor], weight_decays: list[float], adamw: AdamWConfig, *,
                 masters: list[torch.Tensor] | None = None) -> StateStore: ...


def adamw_update(
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    weight_decays: list[float],
    cfg: AdamWConfig,
    *,
    lr: float,
    step: int,
    grad_scale: float = 1.0,
    outs: list[torch.Tensor | None] | None = None,
    one_pass: bool = False,
) -> None:
    """One AdamW update of fp32 ``masters`` in place with torch's own math (``step`` is 1-based).

    Grouped by weight decay; fused on CPU and CUDA (5x faster than foreach on CPU, measured with torch 2.13).
    ``grad_scale`` multiplies the grads inside the fused kernel (which rescales them in place),
    so clipping and loss-scale removal cost no extra gradient copy.  ``outs[i]``, where given,
    receives the new ``masters[i]`` cast to its dtype (the compute-dtype copy offload uploads).

    With ``one_pass`` (ZeRO-Offload's host store asks for it), runs of tensors lying back to back in
    flat host buffers go through :func:`deepshard.kernels.host_adam.host_adamw_` when it saves a memory
    pass (a cast copy to write, or a gradient scale that torch's kernel would store back): bitwise the
    same numbers.  Not by default: it compiles with inductor on first use (seconds, and well over
    100 MB of imports and compiler in each process), which the NVMe stores, run in memory sized to
    their buffers, must not pay for a 4-byte-per-element saving.
    """
    groups: dict[float, list[int]] = {}
    for i, wd in enumerate(weight_decays):
        groups.setdefault(wd, []).append(i)
    for wd, idx in groups.items():
        idx = [i for i in idx if masters[i].numel() > 0]
        if not idx:
            continue
        device = masters[idx[0]].device
        if one_pass and host_adamw_runs_ is not None and device.type == "cpu" and (
                outs is not None or grad_scale != 1.0):
            idx = host_adamw_runs_((masters, grads, exp_avgs, exp_avg_sqs), outs, idx,
                                   min_numel=HOST_ADAM_MIN_NUMEL, lr=lr, beta1=cfg.betas[0], beta2=cfg.betas[1],
                                   eps=cfg.eps, weight_decay=wd, step=step, grad_scale=grad_scale)
            if not idx:
                continue
        fused = device.type in ("cpu", "cuda")
        steps = [torch.tensor(float(step - 1), device=device if fused else "cpu") for _ in idx]
        group_grads = [grads[i] for i in idx]
        inv_scale = None
        if grad_scale != 1.0:
            if fused:
                inv_scale = torch.tensor(1.0 / grad_scale, device=device)
            else:
                group_grads = [g * grad_scale for g in group_grads]
        adamw(
            [masters[i] for i in idx],
            group_grads,
            [exp_avgs[i] for i in idx],
            [exp_avg_sqs[i] for i in idx],
            [],
            steps,
            fused=fused,
            foreach=False if fused else None,
            grad_scale=inv_scale,
            amsgrad=False,
            beta1=cfg.betas[0],
            beta2=cfg.betas[1],
            lr=lr,
            weight_decay=wd,
            eps=cfg.eps,
            maximize=False,
        )
        for i in idx if outs is not None else ():
            if outs[i] is not None:
                outs[i].copy_(masters[i])


class DeviceStateStore(StateStore):
    """State beside the params.  With fp32 params the master *is* the param: no extra bytes.
    ``masters`` (see :class:`StoreFactory`) become the store's own: it keeps them, no copy."""

    def __init__(self, params: list[torch.Tensor], weight_decays: list[float], adamw: AdamWConfig, *,
                 masters: list[torch.Tensor] | None = None) -> None:
        super().__init__(params, weight_decays, adamw)
        self.aliased = all(p.dtype == torch.float32 for p in params)
        if self.aliased:
            assert masters is None, "fp32 params are their own masters"
            self.masters = list(params)
        elif masters is not None:
            assert all(m.dtype == torch.float32 and m.shape == p.shape for m, p in zip(masters, params, strict=True))
            self.masters = list(masters)
        else:
            self.masters = [p.detach().float().clone() for p in params]
        self.exp_avgs = [torch.zeros_like(m) for m in self.masters]
        self.exp_avg_sqs = [torch.zeros_like(m) for m in self.masters]

    def step(self, grads: list[torch.Tensor], *, lr: float, step: int, grad_scale: float = 1.0) -> None:
        g32 = [g.float() if g.dtype != torch.float32 else g for g in grads]
        adamw_update(self.masters, g32, self.exp_avgs, self.exp_avg_sqs, self.weight_decays, self.adamw,
                     lr=lr, step=step, grad_scale=grad_scale)
        if not self.aliased:
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {"master": self.masters, "exp_avg": self.exp_avgs, "exp_avg_sq": self.exp_avg_sqs}

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        for key, dst in self.state_dict().items():
            for d, s in zip(dst, state[key]):
                d.copy_(s)
        if not self.aliased:
            for p, m in zip(self.params, self.masters):
                p.copy_(m)

    def state_bytes(self) -> dict[str, int]:
        owned = self.exp_avgs + self.exp_avg_sqs + ([] if self.aliased else self.masters)
        return {"device": sum(t.numel() * t.element_size() for t in owned), "host": 0, "nvme": 0}

