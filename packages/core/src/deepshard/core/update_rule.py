"""The update rule: what an optimizer step does to a flat run of fp32 masters, apart from where they live.

A :class:`~deepshard.core.state_store.StateStore` decides where the fp32 masters and the rule's
per-parameter states live (device, pinned host, NVMe) and how they move; an :class:`UpdateRule`
names those states and applies one update to tensors the store hands it.  A new rule (SGD with
momentum, Muon, low-precision states) plugs in here without touching any store; checkpoints name
each state ``optim.<state>.<param>``.  :class:`AdamW` keeps torch's fused kernel and the one-pass
host kernel of ``deepshard.kernels``, so its numbers are torch's bit for bit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch.optim.adamw import adamw

from deepshard.core.low_precision import StochasticRounder, upcast

try:  # optional (design.md: core -> kernels for fused AdamW); torch's fused kernel serves without it
    from deepshard.kernels.host_adam import host_adamw_runs_
except ImportError:  # pragma: no cover - kernels not installed
    host_adamw_runs_ = None

__all__ = ["AdamW", "UpdateRule", "adamw_update"]

# a flat host run this long goes through the one-pass kernel when that saves a pass (see adamw_update);
# a compiled call costs ~0.1 ms more than torch's (dynamo's guards, measured at 1M elements, one thread),
# a quarter of the cast pass it saves at 1M elements: at 4M+ the saving clearly dominates
HOST_ADAM_MIN_NUMEL = 1 << 22


class UpdateRule(ABC):
    """One optimizer update on fp32 tensors, wherever a store keeps them.

    ``states`` names the rule's per-parameter fp32 states (each shaped like its master, zero at the
    start); a store allocates one of each per parameter and passes them back by name.
    """

    states: ClassVar[tuple[str, ...]] = ()
    # the dtype a store keeps the states (and, where the params allow, the masters) in: bf16 halves them
    # (deepshard.core.low_precision says how the fp32 result is rounded back)
    state_dtype: torch.dtype = torch.float32

    def holds(self, name: str, index: int) -> bool:
        """Whether parameter ``index`` has state ``name`` (a rule that mixes updates, such as Muon with
        AdamW, keeps only its own states per parameter; a store allocates nothing for the others)."""
        return True

    @abstractmethod
    def update(self, masters: list[torch.Tensor], grads: list[torch.Tensor], states: Mapping[str, list[torch.Tensor]],
               weight_decays: list[float], *, lr: float, step: int, grad_scale: float) -> None:
        """Update fp32 ``masters`` in place from ``grads * grad_scale`` (``step`` is 1-based).

        Every tensor is fp32 on one device; ``states[name][i]`` belongs to ``masters[i]``.  The grads
        are the store's: the rule may overwrite them.
        """

    def apply(self, masters: list[torch.Tensor], grads: list[torch.Tensor], states: Mapping[str, list[torch.Tensor]],
              weight_decays: list[float], *, lr: float, step: int, grad_scale: float = 1.0,
              outs: list[torch.Tensor | None] | None = None, one_pass: bool = False) -> None:
        """What a store calls: :meth:`update`, then each ``outs[i]`` (where given) receives the new
        ``masters[i]`` cast to its dtype.  ``one_pass`` lets a rule fuse that cast into its own pass
        on host memory (a hint; the result must be the same)."""
        self.update(masters, grads, states, weight_decays, lr=lr, step=step, grad_scale=grad_scale)
        for i in range(len(masters)) if outs is not None else ():
            if outs[i] is not None:
                outs[i].copy_(masters[i])


@dataclass(frozen=True)
class AdamW(UpdateRule):
    """AdamW with torch's math (lr comes per step from the schedule, weight decay per parameter)."""

    states: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    state_dtype: torch.dtype = torch.float32
    rounder: StochasticRounder = field(default_factory=StochasticRounder, compare=False, repr=False)

    def update(self, masters: list[torch.Tensor], grads: list[torch.Tensor], states: Mapping[str, list[torch.Tensor]],
               weight_decays: list[float], *, lr: float, step: int, grad_scale: float) -> None:
        self.apply(masters, grads, states, weight_decays, lr=lr, step=step, grad_scale=grad_scale)

    def apply(self, masters: list[torch.Tensor], grads: list[torch.Tensor], states: Mapping[str, list[torch.Tensor]],
              weight_decays: list[float], *, lr: float, step: int, grad_scale: float = 1.0,
              outs: list[torch.Tensor | None] | None = None, one_pass: bool = False) -> None:
        exp_avgs, exp_avg_sqs = states["exp_avg"], states["exp_avg_sq"]
        if all(t.dtype == torch.float32 for ts in (masters, exp_avgs) for t in ts):
            adamw_update(masters, grads, exp_avgs, exp_avg_sqs, weight_decays, self, lr=lr,
                         step=step, grad_scale=grad_scale, outs=outs, one_pass=one_pass)
            return
        for i in range(len(masters)):  # bf16 storage: one param at a time in fp32, rounded back
            lowp = (masters[i], exp_avgs[i], exp_avg_sqs[i])
            m32, e32, v32 = (upcast(t) for t in lowp)
            adamw_update([m32], [grads[i]], [e32], [v32], [weight_decays[i]], self, lr=lr, step=step,
                         grad_scale=grad_scale)
            for dst, src in zip(lowp, (m32, e32, v32)):
                self.rounder.store(dst, src)
            if outs is not None and outs[i] is not None:
                outs[i].copy_(masters[i])


def adamw_update(
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    weight_decays: list[float],
    cfg: AdamW,
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
