"""DeepSpeed's training API on deepshard: ``import deepshard.compat.deepspeed as deepspeed``.

``deepspeed.initialize(model=, model_parameters=, config=ds_config)`` returns DeepSpeed's 4-tuple
``(engine, optimizer, training_dataloader, lr_scheduler)``.  The ds_config goes through the app's
translation (``deepshard.compat.ds_config``): the same batch arithmetic, the same one-line warning
for keys we do not support.  See the README section "Coming from DeepSpeed".
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepshard.core import initialize as core_initialize
from deepshard.core.mesh import local_device

from . import comm, zero
from .comm import init_distributed
from .config import CompatConfig, compat_config
from .engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "comm", "init_distributed", "initialize", "zero"]
__version__ = "0.19.8+deepshard"


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks: the ModuleList holding the most parameters (``model.model.layers`` in HF)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"deepspeed.initialize(model={type(model).__name__}): no nn.ModuleList of blocks found; "
                         f"ZeRO-3 shards and gathers per block")
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def _optimizer_defaults(optimizer: Any) -> dict[str, Any]:
    """A torch Adam/AdamW given to initialize(): its hyper-parameters become the engine's."""
    if isinstance(optimizer, Callable) and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError("deepspeed.initialize(optimizer=<callable>): not supported; give a torch.optim.AdamW or "
                         "the ds_config's optimizer section")
    if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        raise ValueError(f"deepspeed.initialize(optimizer={type(optimizer).__name__}): only Adam/AdamW are "
                         f"supported (AdamW with fp32 master weights)")
    g = optimizer.param_groups[0]
    if isinstance(optimizer, torch.optim.Adam) and not isinstance(optimizer, torch.optim.AdamW) and \
            g.get("weight_decay", 0) and not g.get("decoupled_weight_decay", False):
        raise ValueError("deepspeed.initialize(optimizer=torch.optim.Adam(weight_decay>0)): L2-coupled Adam is not "
                         "supported; use torch.optim.AdamW")
    return {"lr": float(g["lr"]), "betas": "[" + ",".join(repr(float(b)) for b in g["betas"]) + "]",
            "eps": float(g["eps"]), "weight_decay": float(g.get("weight_decay", 0.0))}


def _train_only(model: nn.Module, model_parameters: Iterable | None) -> None:
    """DeepSpeed trains the parameters it is given: the others are frozen here."""
    if model_parameters is None:
        return
    given: set[int] = set()
    options: set[str] = set()
    for item in model_parameters:
        if isinstance(item, dict):
            given |= {id(p) for p in item["params"]}
            options |= set(item) - {"params"}
        else:
            given.add(id(item))
    if options:
        print(f"warning: deepspeed.initialize(model_parameters=...): per-group options {sorted(options)} ignored "
              f"(one group; weight decay applies to matrices, not norms/biases)", file=sys.stderr)
    for p in model.parameters():
        if id(p) not in given:
            p.requires_grad_(False)


def _dataloader(training_data: Any, cfg: CompatConfig, collate_fn: Callable | None) -> torch.utils.data.DataLoader:
    """DeepSpeed's DeepSpeedDataLoader: micro-batches of this rank's DistributedSampler share."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(training_data, num_replicas=comm.get_world_size(), rank=comm.get_rank())
    return DataLoader(training_data, batch_size=cfg.micro_batch_size, sampler=sampler, collate_fn=collate_fn)


def _store(cfg: CompatConfig, stage: int) -> tuple[Any, bool]:
    off = {k: v for k, v in cfg.offload.items() if not k.startswith("aio")}
    if not off:
        from deepshard.core import DeviceStateStore

        return DeviceStateStore, False
    from deepshard.offload import OffloadConfig, make_store_factory, validate_offload

    config = OffloadConfig(**off)
    try:
        validate_offload(stage, config.device, config.params)
    except ValueError as err:
        raise ValueError(f"zero_optimization.offload_*: {err}") from None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
    return make_store_factory(config, comm.get_rank(), run_id), config.params == "cpu"


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: dict | str | Path | None = None,
               mesh_param: Any = None, config_params: dict | str | Path | None = None,
               ) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's ``initialize``: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    The optimizer returned is the engine's (AdamW over fp32 masters); the lr_scheduler is None
    (the ds_config's scheduler runs inside ``engine.step()``; ``engine.get_lr()`` reads it).
    """
    if model is None:
        raise ValueError("deepspeed.initialize(): model= is required")
    if mpu is not None or mesh_param is not None:
        raise ValueError("deepspeed.initialize(mpu=/mesh_param=): model parallelism through an mpu is not "
                         "supported; use deepshard.pipeline (pp x dp x tp) instead")
    if lr_scheduler is not None:
        raise ValueError("deepspeed.initialize(lr_scheduler=...): not supported; use the ds_config's scheduler "
                         "section (WarmupLR, WarmupDecayLR, WarmupCosineLR)")
    if config is not None and config_params is not None:
        raise ValueError("deepspeed.initialize(): give config= or config_params=, not both")
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if dist_init_required is not False:
        init_distributed()
    ds_dict = config if isinstance(config, dict) else None
    if optimizer is not None and ds_dict is not None and "optimizer" in ds_dict:
        raise ValueError("deepspeed.initialize(optimizer=...) and the ds_config's optimizer section: give one")
    defaults = _optimizer_defaults(optimizer) if optimizer is not None else None
    cfg = compat_config(config, dp=comm.get_world_size(), cuda=torch.cuda.is_available(),
                        optimizer_defaults=defaults)
    if optimizer is None and "optim.lr" not in cfg.translation.entries:
        raise ValueError("deepspeed.initialize(): no optimizer: add an optimizer section to the ds_config "
                         "(type AdamW) or pass optimizer=torch.optim.AdamW(...)")
    _train_only(model, model_parameters)
    stage = cfg.engine.zero.stage
    on_meta = zero.built_under_init(model)
    if on_meta and stage != 3:
        raise ValueError(f"zero.Init() needs zero_optimization.stage=3 (the ds_config has stage {stage})")
    if not on_meta:
        model.to(local_device())
    store_factory, offload_params = _store(cfg, stage)
    engine = core_initialize(model, cfg.engine, blocks=find_blocks(model), store_factory=store_factory,
                             offload_params=offload_params, materialize=zero.materialize if on_meta else None)
    ds_engine = DeepSpeedEngine(engine, cfg)
    zero._ENGINES.add(ds_engine)
    loader = _dataloader(training_data, cfg, collate_fn) if training_data is not None else None
    return ds_engine, engine.optimizer, loader, None
