"""One optimizer step over any ZeRO stage: overflow check, global-norm clip, store update, gather."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepshard.core.precision import LossScaler
from deepshard.core.state_store import StateStore
from deepshard.core.zero.stages import ZeroStage


@dataclass
class StepStats:
    applied: bool
    grad_norm: float
    lr: float
    loss_scale: float


def global_grad_sq_norm(grads: list[torch.Tensor], replication: list[int]) -> torch.Tensor:
    """Sum of squares over every rank's gradient shards, each distinct element counted once.

    One all-reduce over the world: shards add up; a tensor held identically by ``r`` ranks
    contributes ``1/r`` from each.  An inf/nan anywhere makes the result non-finite.
    """
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g, r in zip(grads, replication):
        if g.numel():
            total += g.float().pow(2).sum() / r
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
