"""The engine behind Trainer's ``model`` / ``optimizer`` / ``lr_scheduler``.

Trainer's loop stays transformers' own: it calls ``optimizer.step()`` once per accumulation
boundary, ``lr_scheduler.step()`` after it and ``get_last_lr()`` to log.  Here ``optimizer.step()``
is the engine's update (clipping, fp16 overflow skipping and the LR schedule inside it) and the
scheduler only reports the rate the engine used: the schedule is a pure function of the update
count, so a checkpoint's engine state is its whole state.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import transformers
from torch import nn

from deepshard.compat.deepspeed import initialize as ds_initialize
from deepshard.core import Engine
from deepshard.core.optim import StepStats

from . import auto


def trainer_ds_config(args: Any, model: nn.Module, *, world_size: int, num_training_steps: int) -> dict:
    """The ds_config filled from ``args``, plus what Trainer itself supplies to DeepSpeed: an AdamW
    from the arguments when the file has no optimizer section."""
    ds = auto.fill(args.deepspeed, args, world_size=world_size, model=model, num_training_steps=num_training_steps)
    if "optimizer" not in ds:
        if not str(getattr(args.optim, "value", args.optim)).startswith("adamw"):
            raise ValueError(f"TrainingArguments(optim={getattr(args.optim, 'value', args.optim)!r}) with "
                             f"deepspeed=: only AdamW is supported (or the ds_config's optimizer section)")
        ds["optimizer"] = {"type": "AdamW", "params": {
            "lr": args.learning_rate, "betas": [args.adam_beta1, args.adam_beta2], "eps": args.adam_epsilon,
            "weight_decay": args.weight_decay}}
    return ds


def build_engine(args: Any, model: nn.Module, *, world_size: int, num_training_steps: int,
                 decay_names: Iterable[str] = ()) -> Any:
    """``deepshard.compat.deepspeed.initialize`` on the filled ds_config: a ``DeepSpeedEngine``.

    Weight decay as transformers + DeepSpeed apply it: with the file's optimizer section, DeepSpeed's
    AdamW over every trainable parameter (one group); without one, transformers' own optimizer, whose
    groups decay only ``decay_names`` (``Trainer.get_decay_parameter_names``: no biases, no norms)."""
    groups = None
    if "optimizer" not in auto.read(args.deepspeed):
        decay = set(decay_names)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    ds = trainer_ds_config(args, model, world_size=world_size, num_training_steps=num_training_steps)
    if args.torch_compile:  # per-block torch.compile in the recipe (before ZeRO), as the compile section's enabled
        ds = {**ds, "compile": {**ds.get("compile", {}), "enabled": True,
                                "backend": args.torch_compile_backend or "inductor"}}
    ds_engine, _, _, _ = ds_initialize(model=model, config=ds, model_parameters=groups)
    if "scheduler" not in ds:  # transformers' lr_scheduler_type, through its own schedule functions
        ds_engine.engine.optimizer.lr_at = hf_schedule(args, ds_engine.engine.config.optim.lr, num_training_steps)
    return ds_engine


def hf_schedule(args: Any, base_lr: float, num_training_steps: int) -> Any:
    """``k -> lr`` of transformers' ``lr_scheduler_type`` (its ``LambdaLR`` factor at update ``k``)."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr)
    sched = transformers.get_scheduler(args.lr_scheduler_type, probe,
                                       num_warmup_steps=args.get_warmup_steps(num_training_steps),
                                       num_training_steps=num_training_steps,
                                       scheduler_specific_kwargs=args.lr_scheduler_kwargs or {})
    if not isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        raise ValueError(f"TrainingArguments(lr_scheduler_type={args.lr_scheduler_type!r}) with deepspeed=: not "
                         f"supported (give the ds_config a scheduler section, or a step-count schedule)")
    factor = sched.lr_lambdas[0]
    return lambda k: base_lr * factor(k)


def count_update(ds_engine: Any, *, applied: bool) -> None:
    """Advance the DeepSpeed engine's counters by one update, as its own ``step()`` would: Trainer
    drives the core engine directly, and without this the checkpoint tag's step, ``global_steps`` in an
    export and the resume line would all stay 0."""
    accum = ds_engine.compat.grad_accum
    ds_engine.micro_steps += accum
    ds_engine.global_samples += accum * ds_engine.compat.micro_batch_size * ds_engine.world_size
    ds_engine.global_steps += 1
    ds_engine.skipped_steps += 0 if applied else 1


class EngineOptimizer(torch.optim.Optimizer):
    """Trainer's ``optimizer``: ``step()`` is the engine's update on the accumulation boundary."""

    def __init__(self, engine: Engine, *, counters: Any = None) -> None:
        params = [p for p in engine.model.parameters() if p.requires_grad]
        super().__init__(params, {"lr": engine.optimizer.lr_at(0)})
        self.engine = engine
        self.counters = counters
        self.last: StepStats | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        stats = self.engine.step()
        assert stats is not None, "Trainer's accumulation boundary and the engine's disagree"
        self.last = stats
        if self.counters is not None:
            count_update(self.counters, applied=stats.applied)
        for group in self.param_groups:
            group["lr"] = stats.lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The engine clears gradients after each update; between micro-batches they accumulate."""


class EngineSchedule:
    """Trainer's ``lr_scheduler``: the rate of the engine's last update (its schedule runs inside)."""

    def __init__(self, optimizer: EngineOptimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        last = self.optimizer.last
        lr = last.lr if last is not None else self.optimizer.engine.optimizer.lr_at(0)
        return [lr]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
