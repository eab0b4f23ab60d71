"""``initialize(optimizer=, lr_scheduler=)``: a script's own optimizer and scheduler on the engine's step.

The engine's update is AdamW over fp32 masters in a state store (device, host or NVMe: the
ds_config's ``offload_optimizer`` decides, as in DeepSpeed).  A script's Adam-family optimizer
gives its hyper-parameters; a script's torch scheduler keeps driving the learning rate: it is
stepped after every applied update, and each update reads the rate it left in its optimizer's
first group (DeepSpeed's order: ``optimizer.step()`` then ``lr_scheduler.step()``).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch
from torch import nn

from deepshard.core.checkpoint.state import clean_name

from .ops.adam import DeepSpeedCPUAdam, FusedAdam

HYPER = ("lr", "betas", "eps")


def optimizer_defaults(optimizer: Any) -> dict[str, Any]:
    """A script's Adam/AdamW/FusedAdam/DeepSpeedCPUAdam as the engine's AdamW hyper-parameters."""
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SGD):
        raise ValueError("deepspeed.initialize(optimizer=torch.optim.SGD): not supported: deepshard's update is "
                         "AdamW over fp32 masters (its state stores hold Adam's two moments, sharded by ZeRO); use "
                         "torch.optim.AdamW or deepspeed.ops.adam.FusedAdam")
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise ValueError(f"deepspeed.initialize(optimizer={name}): only Adam-family optimizers are supported "
                         f"(torch.optim.Adam/AdamW, deepspeed.ops.adam.FusedAdam/DeepSpeedCPUAdam)")
    groups = optimizer.param_groups
    g = groups[0]
    for key in HYPER:
        if any(other[key] != g[key] for other in groups[1:]):
            raise ValueError(f"deepspeed.initialize(optimizer={name}): parameter groups with different {key!r} are "
                             f"not supported (one AdamW over every parameter); give every group the same {key}")
    if g.get("amsgrad", False):
        raise ValueError(f"deepspeed.initialize(optimizer={name}(amsgrad=True)): not supported")
    if g.get("maximize", False):
        raise ValueError(f"deepspeed.initialize(optimizer={name}(maximize=True)): not supported")
    decoupled = isinstance(optimizer, torch.optim.AdamW) or g.get("decoupled_weight_decay", False)
    if g.get("weight_decay", 0) and not decoupled:
        hint = "adam_w_mode=True" if isinstance(optimizer, (FusedAdam, DeepSpeedCPUAdam)) else "torch.optim.AdamW"
        raise ValueError(f"deepspeed.initialize(optimizer={name}(weight_decay>0)): L2-coupled Adam is not supported; "
                         f"use {hint} (decoupled weight decay)")
    # a scheduler built over it already set lr (to 0 at a warm-up's start): its base rate is initial_lr
    return {"lr": float(g.get("initial_lr", g["lr"])), "betas": [float(b) for b in g["betas"]],
            "eps": float(g["eps"]), "weight_decay": float(g.get("weight_decay", 0.0))}


def group_decays(model: nn.Module, optimizer: Any) -> dict[str, float]:
    """Each trainable parameter's weight decay as the script's optimizer groups give it (by name, taken
    before ``initialize`` replaces the parameters), as DeepSpeed's optimizer applies it: every group's
    own ``weight_decay`` (a group of biases and norms with 0.0, DeepSpeed-Chat's split)."""
    by_id = {id(p): float(g.get("weight_decay", 0.0)) for g in optimizer.param_groups for p in g["params"]}
    return {clean_name(n): by_id[id(p)] for n, p in model.named_parameters() if id(p) in by_id}


def apply_group_decays(engine: Any, decays: dict[str, float]) -> None:
    """The engine's AdamW (one decay per parameter in its state store) takes the script's per-group decays."""
    stage, store = engine.stage, engine.optimizer.store
    assert len(stage.names) == len(store.weight_decays)
    store.weight_decays[:] = [decays.get(clean_name(n), wd) for n, wd in zip(stage.names, store.weight_decays)]


class _LRCarrier(torch.optim.Optimizer):
    """What a scheduler callable is given when the ds_config built the optimizer: one group whose
    ``lr`` the scheduler sets and the engine's update reads (it updates nothing itself)."""

    def __init__(self, lr: float) -> None:
        super().__init__([torch.zeros(1, requires_grad=True)], {"lr": lr})

    def step(self, closure: Any = None) -> None:
        raise ValueError("this optimizer only carries the learning rate; engine.step() updates the model")


class ConfigSchedule:
    """``lr_scheduler`` returned when the ds_config's scheduler section drives the rate: a read-only
    view (``engine.step()`` advances it, as DeepSpeed's engine does)."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = None  # not a client scheduler: the engine does not step it
        self._engine_optimizer = optimizer

    def get_last_lr(self) -> list[float]:
        opt = self._engine_optimizer
        return [opt.lr_at(opt.num_updates)]

    get_lr = get_last_lr

    @property
    def last_batch_iteration(self) -> int:
        return self._engine_optimizer.num_updates - 1

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("lr_scheduler.step(): the ds_config's scheduler is advanced by engine.step(); do not step "
                         "it yourself (that would skip rates)")


def client_scheduler(lr_scheduler: Any, optimizer: Any, engine_optimizer: Any, *, config_scheduler: bool) -> Any:
    """The scheduler ``initialize`` returns, with the engine's update reading its rate."""
    if lr_scheduler is None:
        if config_scheduler:
            return ConfigSchedule(engine_optimizer)
        if isinstance(optimizer, torch.optim.Optimizer):
            # DeepSpeed's optimizer shares the script's param_groups: a rate set there drives the update
            # (transformers' Trainer builds its scheduler after initialize, over the optimizer returned)
            groups = optimizer.param_groups
            engine_optimizer.param_groups = groups
            engine_optimizer.lr_at = lambda _num_updates: float(groups[0]["lr"])
        return None
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        scheduler = lr_scheduler
        if optimizer is not None and scheduler.optimizer is not optimizer:
            raise ValueError("deepspeed.initialize(lr_scheduler=...): the scheduler must be built over the "
                             "optimizer= given to initialize")
    elif callable(lr_scheduler):
        carrier = optimizer if optimizer is not None else _LRCarrier(engine_optimizer.lr_at(0))
        scheduler = lr_scheduler(carrier)
        if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise ValueError(f"deepspeed.initialize(lr_scheduler=<callable>): it returned "
                             f"{type(scheduler).__name__}, expected a torch.optim.lr_scheduler scheduler")
    else:
        raise ValueError(f"deepspeed.initialize(lr_scheduler={type(lr_scheduler).__name__}): expected a "
                         f"torch.optim.lr_scheduler scheduler or a callable(optimizer) returning one")
    groups = scheduler.optimizer.param_groups
    engine_optimizer.lr_at = lambda _num_updates: float(groups[0]["lr"])
    return scheduler


def step_scheduler(scheduler: Any) -> None:
    """Step a client scheduler (its optimizer's own ``step`` never runs: torch's order warning is moot)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        scheduler.step()


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    """A client scheduler's state for the checkpoint (DeepSpeed saves ``lr_scheduler.state_dict()``), its
    JSON values only: checkpoints here hold no pickles, and what is dropped (lambdas) torch does not restore."""
    if getattr(scheduler, "optimizer", None) is None:
        return {}
    kept = {}
    for key, value in scheduler.state_dict().items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        kept[key] = value
    return {"lr_scheduler": kept}


def load_group_rate(engine_optimizer: Any, app: dict[str, Any]) -> None:
    """DeepSpeed's load restores its optimizer's groups, with the rate of the next update that the
    script's scheduler had left there (transformers' Trainer steps its own scheduler, outside the engine,
    and a torch scheduler's ``load_state_dict`` does not set it again): the script's groups the update
    reads here (``client_scheduler``) get the saved rate."""
    saved = app.get("optimizer", {}).get("lr")
    groups = getattr(engine_optimizer, "param_groups", None)
    if saved is None or not groups:
        return
    for group in groups:
        group["lr"] = float(saved)


def load_scheduler_state(scheduler: Any, app: dict[str, Any]) -> None:
    """Restore a client scheduler and the rate it left in its optimizer (the next update's)."""
    state = app.get("lr_scheduler")
    if state is None or getattr(scheduler, "optimizer", None) is None:
        return
    scheduler.load_state_dict({**scheduler.state_dict(), **state})
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
