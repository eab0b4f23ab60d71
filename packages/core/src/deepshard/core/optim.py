"""One optimizer step over any ZeRO stage: overflow check, global-norm clip, store update, gather."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepshard.core.mesh import local_device
from deepshard.core.precision import LossScaler
from deepshard.core.state_store import StateStore
from deepshard.core.zero.stages import ZeroStage


@dataclass
class StepStats:
    applied: bool
    grad_norm: float
    lr: float
    loss_scale: float


def global_grad_sq_norm(grads: list[torch.Tensor], replication: list[int], *,
                        device: torch.device | None = None) -> torch.Tensor:
    """Sum of squares over every rank's gradient shards, each distinct element counted once.

    One all-reduce over the world: shards add up; a tensor held identically by ``r`` ranks
    contributes ``1/r`` from each.  An inf/nan anywhere makes the result non-finite.  The total
    lives on the compute device (``device``, default ``local_device()``) wherever the grads are:
    with ``offload.params=cpu`` FSDP2 keeps gradient shards on the host, and nccl takes no host
    tensor.  Norms are taken with one ``_foreach_norm`` per (device, dtype, replication) group, in
    fp32 (an fp16 sum of squares would overflow long before the gradients do).
    """
    device = local_device() if device is None else device
    groups: dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]] = {}
    for g, r in zip(grads, replication):
        if g.numel():
            groups.setdefault((g.device, g.dtype, r), []).append(g)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (_, _, r), tensors in groups.items():
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        total += (torch.stack(norms).square().sum() / r).to(device)
    dist.all_reduce(total)
    return total


class ZeroOptimizer:
    """AdamW through a StateStore, with fp16 overflow skipping and global-norm clipping."""

    def __init__(self, stage: ZeroStage, store: StateStore, lr_at: Callable[[int], float],
                 scaler: LossScaler, grad_clip: float) -> None:
        self.stage = stage
        self.store = store
        self.lr_at = lr_at
        self.scaler = scaler
        self.grad_clip = grad_clip
        self.num_updates = 0
        stage.on_grad_ready = store.grad_ready

    def step(self) -> StepStats:
        grads = self.stage.local_grads()
        for i, g in enumerate(grads):
            if i not in self.stage.reported:  # the rest were handed over while backward ran
                self.store.grad_ready(i, g)
        sq = global_grad_sq_norm(grads, self.stage.replication())
        scale = self.scaler.scale
        lr = self.lr_at(self.num_updates)
        if not torch.isfinite(sq):
            self.scaler.update(overflow=True)
            self.stage.zero_grad()
            return StepStats(False, float("nan"), lr, scale)
        norm = sq.sqrt().item() / scale
        coef = 1.0
        if self.grad_clip > 0:
            coef = min(1.0, self.grad_clip / (norm + 1e-6))
        self.store.step(grads, lr=lr, step=self.num_updates + 1, grad_scale=coef / scale)
        self.stage.after_step()
        self.stage.zero_grad()
        self.scaler.update(overflow=False)
        self.num_updates += 1
        return StepStats(True, norm, lr, scale)
