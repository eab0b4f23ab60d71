"""One optimizer step over any ZeRO stage: overflow check, global-norm clip, store update, gather."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deepshard.core.config import EngineConfig, OptimConfig
from deepshard.core.low_precision import LOW_PRECISION_DTYPES
from deepshard.core.mesh import local_device
from deepshard.core.precision import LossScaler
from deepshard.core.schedules import LRSchedule
from deepshard.core.state_store import DeviceStateStore, StateStore, StoreFactory
from deepshard.core.update_rule import AdamW, UpdateRule
from deepshard.core.zero.stages import ZeroStage


@dataclass
class StepStats:
    applied: bool
    grad_norm: float
    lr: float
    loss_scale: float
    # the global L2 norm of the trainable parameters the step left (non-finite if any is); None: the
    # step was skipped, or the parameters are not in memory to measure
    param_norm: float | None = None
    # the update whose state param_norm measures when it is not this step's: under offload.params=nvme each
    # update is applied in the next forward, so a step reports the state the previous update left
    param_norm_step: int | None = None


def _local_sq_norm(tensors: list[torch.Tensor], replication: list[int], device: torch.device) -> torch.Tensor:
    """This rank's share of the global sum of squares: a tensor held by ``r`` ranks counts ``1/r``.

    One ``_foreach_norm`` per (device, dtype, replication) group, in fp32 (an fp16 sum of squares
    would overflow long before the values do); the total on ``device`` wherever the tensors are.
    """
    groups: dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]] = {}
    for t, r in zip(tensors, replication):
        if t.numel():
            groups.setdefault((t.device, t.dtype, r), []).append(t)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (_, _, r), group in groups.items():
        norms = torch._foreach_norm(group, 2, dtype=torch.float32)
        total += (torch.stack(norms).square().sum() / r).to(device)
    return total


def global_grad_sq_norm(grads: list[torch.Tensor], replication: list[int], *,
                        device: torch.device | None = None) -> torch.Tensor:
    """Sum of squares over every rank's gradient shards, each distinct element counted once.

    One all-reduce over the world: shards add up; a tensor held identically by ``r`` ranks
    contributes ``1/r`` from each.  An inf/nan anywhere makes the result non-finite.  The total
    lives on the compute device (``device``, default ``local_device()``) wherever the grads are:
    with ``offload.params=cpu`` FSDP2 keeps gradient shards on the host, and nccl takes no host
    tensor.
    """
    total = _local_sq_norm(grads, replication, local_device() if device is None else device)
    dist.all_reduce(total)
    return total


def _resident(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are in memory (a swapped-out param's storage is resized to 0)."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def global_param_norm(params: list[torch.Tensor], replication: list[int], *,
                      device: torch.device | None = None) -> float | None:
    """The global L2 norm of every rank's parameter shards (as :func:`global_grad_sq_norm` counts
    them), in one all-reduce of two scalars; None when any rank's are not all in memory."""
    device = local_device() if device is None else device
    missing = sum(1.0 for p in params if p.numel() and not _resident(p))
    held = [] if missing else params
    both = torch.stack([_local_sq_norm(held, replication, device),
                        torch.tensor(missing, dtype=torch.float32, device=device)])
    dist.all_reduce(both)
    sq, unmeasured = both.tolist()
    return None if unmeasured else math.sqrt(sq) if math.isfinite(sq) else math.nan


class ZeroOptimizer:
    """The store's update rule (AdamW by default) over a ZeRO stage, with fp16 overflow skipping and
    global-norm clipping."""

    def __init__(self, stage: ZeroStage, store: StateStore, lr_at: Callable[[int], float],
                 scaler: LossScaler, grad_clip: float) -> None:
        self.stage = stage
        self.store = store
        self.lr_at = lr_at
        self.scaler = scaler
        self.grad_clip = grad_clip
        self.num_updates = 0
        # seconds spent waiting for the stage's collectives, for profilers (they read and reset it)
        self.comm_wait_s = {"backward": 0.0, "optimizer": 0.0}
        self.shared: dict[int, int] = {}  # see count_shared
        for handoff, offset in stage.grad_handoffs():  # final shards reach the store during backward
            handoff.bind(store.grad_ready, offset=offset)

    def count_shared(self, holders: dict[int, int]) -> None:
        """Gradients held, summed and equal, by ranks beyond the stage's own group (a weight tied across
        pipeline stages: each stage keeps a copy): ``holders`` maps the gradient's index to how many
        hold it, and each copy counts ``1/k`` in the global grad and param norms."""
        self.shared = dict(holders)

    def replication(self) -> list[int]:
        """Per local gradient, how many ranks hold the same values: the stage's count, times
        :meth:`count_shared`'s."""
        return [r * self.shared.get(i, 1) for i, r in enumerate(self.stage.replication())]

    def finish_backward(self) -> None:
        """Wait for the reductions launched during backward (timed as communication wait)."""
        t0 = time.perf_counter()
        self.stage.finish_backward()
        self.comm_wait_s["backward"] += time.perf_counter() - t0

    def step(self) -> StepStats:
        self.stage.gather_params()  # an all-gather still running into the forward ends before shards change
        grads = self.stage.local_grads()
        handed_over = self.stage.handed_over()
        for i, g in enumerate(grads):
            if i not in handed_over:  # the rest reached the store while backward ran
                self.store.grad_ready(i, g)
        sq = global_grad_sq_norm(grads, self.replication())
        scale = self.scaler.scale
        lr = self.lr_at(self.num_updates)
        if not torch.isfinite(sq):
            self.scaler.update(overflow=True)
            self.stage.zero_grad()
            # a deferred update (NVMe params): the previous one's state is still news (this step's loss came from it)
            param_norm, of = self.measured_norm() if self.store.defers_update else (None, None)
            of = self.num_updates if param_norm is not None else None  # judged now, though this step is skipped
            return StepStats(False, float("nan"), lr, scale, param_norm=param_norm, param_norm_step=of)
        norm = sq.sqrt().item() / scale
        coef = 1.0
        if self.grad_clip > 0:
            coef = min(1.0, self.grad_clip / (norm + 1e-6))
        self.store.step(grads, lr=lr, step=self.num_updates + 1, grad_scale=coef / scale)
        t0 = time.perf_counter()
        self.stage.after_step()
        self.comm_wait_s["optimizer"] += time.perf_counter() - t0
        self.stage.zero_grad()
        self.scaler.update(overflow=False)
        self.num_updates += 1
        param_norm, of = self.measured_norm()
        return StepStats(True, norm, lr, scale, param_norm=param_norm, param_norm_step=of)

    def param_norm(self) -> float | None:
        """The global L2 norm of the trainable parameters now (NaN if any is not finite), one
        all-reduce of two scalars; under a deferred update (offload.params=nvme) the update still owed
        is applied first.  What a divergence check compares step to step."""
        return self.measured_norm(settle=True)[0]

    def measured_norm(self, *, settle: bool = False) -> tuple[float | None, int | None]:
        """``(norm, of)``: the global parameter norm and, under a store that defers its update, the step
        of the update whose state it measures (``settle``: the owed one, applied now; else the newest
        applied in full, or None before any); ``of`` is None when the norm is of the params now."""
        if not self.store.defers_update:
            return global_param_norm(self.stage.local_params(), self.replication()), None
        got = self.store.applied_param_sq(settle=settle)
        device = local_device()
        sq = sum(x / r for x, r in zip(got[1], self.replication(), strict=True)) if got else 0.0
        both = torch.tensor([sq, 0.0 if got else 1.0], dtype=torch.float64, device=device)
        if dist.is_initialized():
            dist.all_reduce(both)
        total, unmeasured = both.tolist()
        if unmeasured or got is None:
            return None, None
        of = None if settle or got[0] == self.num_updates else got[0]
        return (math.sqrt(total) if math.isfinite(total) else math.nan), of


def decays(params: list[torch.Tensor], weight_decay: float) -> list[float]:
    """Weight decay on matrices only: norms and biases are not decayed (the common LLM recipe)."""
    return [weight_decay if p.dim() >= 2 else 0.0 for p in params]


def update_rule(stage: ZeroStage, oc: OptimConfig) -> UpdateRule:
    """The update ``oc`` names over ``stage``'s parameters: AdamW, or Muon on the hidden matrices
    (core/muon.py's split) with AdamW on the rest."""
    if oc.name == "adamw":
        return rule_for(oc, stage.names, [])
    for name, p in zip(stage.names, stage.params):
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) and mesh["tp"].size() > 1:
            raise ValueError(f"optim.name=muon with tensor parallelism: {name} is split across tp ranks and "
                             "Muon's Newton-Schulz over tp-sharded matrices is not built (use parallel.tp=1)")
    return rule_for(oc, stage.names, [tuple(p.shape) for p in stage.params], group=stage.shard_group(),
                    device=local_device())


def rule_for(oc: OptimConfig, names: Sequence[str], shapes: Sequence[tuple[int, ...]],
             group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> UpdateRule:
    """The rule ``oc`` names for parameters of these names and (global) shapes; ``group``: the shard group
    Muon gathers row chunks over (None: whole tensors, or a count of states before any worker starts);
    ``device``: where Muon's collectives run when a store keeps its states on the host."""
    state_dtype = LOW_PRECISION_DTYPES[oc.state_dtype]
    adam = AdamW(betas=tuple(oc.betas), eps=oc.eps, state_dtype=state_dtype)
    if oc.name == "adamw":
        return adam
    from deepshard.core.muon import Muon, muon_split

    shapes = tuple(tuple(s) for s in shapes)
    return Muon(use_muon=tuple(muon_split(names, shapes)), shapes=shapes, group=group,
                adam=adam, base_lr=oc.lr, muon_lr=oc.muon_lr, momentum=oc.momentum, nesterov=oc.nesterov,
                ns_steps=oc.ns_steps, ns_dtype=LOW_PRECISION_DTYPES[oc.ns_dtype], state_dtype=state_dtype,
                device=device)


def build_optimizer(stage: ZeroStage, config: EngineConfig, *, store_factory: StoreFactory = DeviceStateStore,
                    fp32_masters: list[torch.Tensor] | None = None, rule: UpdateRule | None = None) -> ZeroOptimizer:
    """The optimizer over a ZeRO stage (one model, or a pipeline rank's stage modules seen as one):
    its state store, fp32 masters, LR schedule and loss scaler, from ``config``.

    ``fp32_masters``: this rank's fp32 local shards taken before the params were cast to a 16-bit
    compute dtype (stages 0-2), so the masters start from the exact init, not its rounded copy.
    ``rule``: the update (None: AdamW with ``config.optim``'s betas and eps).
    """
    oc = config.optim
    if rule is None:
        rule = update_rule(stage, oc)
    if rule.state_dtype != torch.float32:
        fp32_masters = None  # bf16 masters: the bf16 params are their own (DeviceStateStore)
    store = store_factory(stage.local_params(), decays(stage.params, oc.weight_decay), rule, masters=fp32_masters)
    schedule = LRSchedule(config.scheduler, oc.lr)
    return ZeroOptimizer(stage, store, schedule.lr_at, LossScaler(config.precision), oc.grad_clip)
