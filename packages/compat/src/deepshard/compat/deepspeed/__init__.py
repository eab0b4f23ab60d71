"""DeepSpeed's training API on deepshard: ``import deepshard.compat.deepspeed as deepspeed``.

``deepspeed.initialize(model=, model_parameters=, config=ds_config)`` returns DeepSpeed's 4-tuple
``(engine, optimizer, training_dataloader, lr_scheduler)``.  The ds_config goes through the app's
translation (``deepshard.compat.ds_config``): the same batch arithmetic, the same one-line warning
for keys we do not support.  See the README section "Coming from DeepSpeed".
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepshard.core import initialize as core_initialize
from deepshard.core.mesh import local_device
from deepshard.core.zero import ParamOffload

from . import accelerator, comm, compression, moe, ops, param_offload, pipe, runtime, utils, zero
from .accelerator import get_accelerator
from .comm import init_distributed
from .config import CompatConfig, compat_config, config_decays, read_ds_config
from .engine import DeepSpeedEngine
from .schedule import apply_group_decays, client_scheduler, group_decays, optimizer_defaults

__all__ = ["DeepSpeedEngine", "accelerator", "add_config_arguments", "comm", "compression", "get_accelerator", "init_distributed",
           "initialize", "moe", "ops", "pipe", "runtime", "utils", "zero"]
__version__ = "0.19.8+deepshard"


def find_blocks(model: nn.Module, *, ac: str = "none") -> nn.ModuleList:
    """The transformer blocks: the ModuleList holding the most parameters (``model.model.layers`` in HF).

    A model without one (CIFAR's ``Net``) gets none: ZeRO 0-2 need no blocks, and ZeRO-3 gathers the
    whole model as one unit (its memory saving is then the optimizer state and gradients only).
    """
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        if ac != "none":
            raise ValueError(f"activation_checkpointing: model={type(model).__name__} has no nn.ModuleList of blocks "
                             f"to checkpoint; remove the section or checkpoint inside the model")
        return nn.ModuleList()
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's: a "DeepSpeed" argument group with ``--deepspeed``, ``--deepspeed_config`` (and the
    deprecated ``--deepscale``, ``--deepscale_config``); ``initialize(args=args)`` reads the config path."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file.")
    return parser


def _train_only(model: nn.Module, model_parameters: Iterable | None) -> None:
    """DeepSpeed trains the parameters it is given (or the client optimizer's): the others are frozen here."""
    if model_parameters is None:
        return
    given: set[int] = set()
    options: set[str] = set()
    for item in model_parameters:
        if isinstance(item, dict):
            given |= {id(p) for p in item["params"]}
            options |= set(item) - {"params", "weight_decay"}  # each group's weight_decay is honoured
        else:
            given.add(id(item))
    if options:
        print(f"warning: deepspeed.initialize(model_parameters=...): per-group options {sorted(options)} ignored "
              f"(one AdamW; each group's weight_decay is honoured)", file=sys.stderr)
    for p in model.parameters():
        if id(p) not in given:
            p.requires_grad_(False)


def _dataloader(training_data: Any, cfg: CompatConfig, collate_fn: Callable | None) -> torch.utils.data.DataLoader:
    """DeepSpeed's DeepSpeedDataLoader: micro-batches of this rank's DistributedSampler share."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(training_data, num_replicas=comm.get_world_size(), rank=comm.get_rank())
    return DataLoader(training_data, batch_size=cfg.micro_batch_size, sampler=sampler, collate_fn=collate_fn)


def _store(cfg: CompatConfig, stage: int) -> tuple[Any, ParamOffload | None]:
    off = {k: v for k, v in cfg.offload.items() if not k.startswith("aio")}
    if not off:
        from deepshard.core import DeviceStateStore

        return DeviceStateStore, None
    from deepshard.offload import OffloadConfig, make_store_factory, param_offload, validate_offload

    config = OffloadConfig(**off)
    try:
        validate_offload(stage, config.device, config.params)
    except ValueError as err:
        raise ValueError(f"zero_optimization.offload_*: {err}") from None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
    factory = make_store_factory(config, comm.get_rank(), run_id)
    return factory, param_offload(config, factory)  # params=nvme: the factory's ParamSwap, hooked into the model


def initialize(args: Any = None, model: nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int | None = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable | None = None, config: dict | str | Path | None = None,
               mesh_param: Any = None, config_params: dict | str | Path | None = None,
               ) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """DeepSpeed's ``initialize``: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``optimizer=``: torch's Adam/AdamW or ``deepspeed.ops.adam``'s FusedAdam/DeepSpeedCPUAdam built by the
    script (or a callable building one from ``model_parameters``); their hyper-parameters become the engine's AdamW over fp32 masters (and their parameters
    the trained ones; each group's ``weight_decay`` applies to its parameters, as in DeepSpeed).  The optimizer returned is the engine's.  ``lr_scheduler=``: a torch scheduler
    over that optimizer, or a callable taking the optimizer and returning one; the engine steps it
    after each applied update and each update uses its current rate, as DeepSpeed does.  Without it,
    the ds_config's scheduler runs inside ``engine.step()`` and the scheduler returned reads it.
    """
    if model is None:
        raise ValueError("deepspeed.initialize(): model= is required")
    if mpu is not None or mesh_param is not None:
        raise ValueError("deepspeed.initialize(mpu=/mesh_param=): model parallelism through an mpu is not "
                         "supported; use deepshard.pipeline (pp x dp x tp) instead")
    ep, experts = moe.layer.expert_parallel(model)  # experts split over ep_size > 1 ranks: their own ZeRO group
    if config is not None and config_params is not None:
        raise ValueError("deepspeed.initialize(): give config= or config_params=, not both")
    config = config if config is not None else config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if dist_init_required is not False:
        init_distributed()
    if comm.is_initialized():
        comm.close_group_at_exit()
    ds_dict = read_ds_config(config)[0]
    if optimizer is not None and ds_dict is not None and "optimizer" in ds_dict:
        raise ValueError("deepspeed.initialize(optimizer=...) and the ds_config's optimizer section: give one")
    if lr_scheduler is not None and ds_dict is not None and "scheduler" in ds_dict:
        raise ValueError("deepspeed.initialize(lr_scheduler=...) and the ds_config's scheduler section: give one")
    if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):  # DeepSpeed: optimizer(params)
        model_parameters = (list(model_parameters) if model_parameters is not None
                            else [p for p in model.parameters() if p.requires_grad])
        optimizer = optimizer(model_parameters)
    defaults = optimizer_defaults(optimizer) if optimizer is not None else None
    pipelined = isinstance(model, pipe.PipelineModule)
    dp = comm.get_world_size() // (model.num_stages if pipelined else 1)
    cfg = compat_config(config, dp=max(dp, 1), cuda=torch.cuda.is_available(), optimizer_defaults=defaults)
    if optimizer is None and "optim.lr" not in cfg.translation.entries:  # DeepSpeed: an engine for forward only
        if pipelined or lr_scheduler is not None or training_data is not None:
            raise ValueError("deepspeed.initialize(): no optimizer: add an optimizer section to the ds_config "
                             "(type AdamW) or pass optimizer=torch.optim.AdamW(...)")
        return _initialize_inference(model, cfg, ds_dict)
    if model_parameters is None and optimizer is not None:
        model_parameters = [p for g in optimizer.param_groups for p in g["params"]]
    if model_parameters is not None:  # a generator (model.parameters()) is read twice below
        model_parameters = list(model_parameters)
    _train_only(model, model_parameters)
    if ep > 1 and pipelined:
        raise ValueError(f"deepspeed.initialize(): a PipelineModule with MoE ep_size={ep}: expert parallelism is "
                         f"not built with pipelines; use ep_size=1")
    if pipelined:
        return _initialize_pipeline(model, cfg, ds_dict, optimizer, lr_scheduler, training_data, collate_fn)
    stage = cfg.engine.zero.stage
    on_meta = zero.built_under_init(model)
    if on_meta and stage != 3:
        raise ValueError(f"zero.Init() needs zero_optimization.stage=3 (the ds_config has stage {stage})")
    if on_meta:
        zero.keep_real_params(model)  # PEFT's adapters, made after from_pretrained under zero.Init
    else:
        model.to(local_device())
    store_factory, offload_params = _store(cfg, stage)
    blocks = find_blocks(model, ac=cfg.engine.ac)
    if ep > 1 and any(b is e for b in blocks for e in experts):  # experts are their own units, over edp
        blocks = nn.ModuleList()
    if stage == 3:
        zero.check_external_parameters(model, blocks)
    # each parameter's decay, by name before ZeRO-3 swaps the params: the script's optimizer groups', or
    # DeepSpeed's for the ds_config's optimizer (its weight_decay on every parameter of each group)
    decays = group_decays(model, optimizer) if optimizer is not None else \
        config_decays(model, model_parameters, cfg.engine.optim.weight_decay)
    mesh, parallelize = _expert_parallel(cfg, ep, experts, blocks, offload_params) if ep > 1 else (None, None)
    engine = core_initialize(model, cfg.engine, blocks=blocks, store_factory=store_factory, mesh=mesh,
                             parallelize_fn=parallelize, offload_params=offload_params,
                             materialize=zero.materialize if on_meta else None)
    if decays:
        apply_group_decays(engine, decays)
    if stage == 3:
        zero.tag_zero3_params(model)
        zero.fsdp_lazy_init(model)
        param_offload.attach(engine.optimizer, model)  # TRL's generation removes and restores ZeRO-3's hooks
    scheduler = client_scheduler(lr_scheduler, optimizer, engine.optimizer, config_scheduler="scheduler" in ds_dict)
    ds_engine = DeepSpeedEngine(engine, cfg, ds_config=ds_dict, lr_scheduler=scheduler)
    ds_engine.offload_params = offload_params  # the save of HF weights reads NVMe shards back through it
    zero._ENGINES.add(ds_engine)
    loader = _dataloader(training_data, cfg, collate_fn) if training_data is not None else None
    return ds_engine, engine.optimizer, loader, scheduler


def _expert_parallel(cfg: CompatConfig, ep: int, experts: list[nn.Module], blocks: nn.ModuleList,
                     offload_params: ParamOffload | None) -> tuple[Any, Callable]:
    """The mesh with ``ep`` (consecutive ranks) and ``edp`` axes, and core's recipe told which modules are
    this rank's experts: ZeRO shards and reduces them over ``edp`` (DeepSpeed's expert-data-parallel group),
    the dense params over all dp ranks."""
    from functools import partial

    from deepshard.core import ParallelDims, build_mesh
    from deepshard.core.parallelize import parallelize_model

    e = cfg.engine
    mesh = build_mesh(ParallelDims(ep=ep))
    return mesh, partial(parallelize_model, mesh=mesh, zero=e.zero, dtype=e.precision.dtype, ac=e.ac, blocks=blocks,
                         offload_params=offload_params, ac_offload=e.ac_offload, compile=e.compile, experts=experts)


def _initialize_inference(model: nn.Module, cfg: CompatConfig, ds_dict: dict) -> tuple:
    """No optimizer (TRL's reference models): ``(engine, None, None, None)`` as DeepSpeed returns."""
    from .inference import initialize_inference

    offload_params = _store(cfg, cfg.engine.zero.stage)[1]
    engine = initialize_inference(model, cfg, ds_dict, blocks=find_blocks(model), offload_params=offload_params)
    return engine, None, None, None


def _initialize_pipeline(model: pipe.PipelineModule, cfg: CompatConfig, ds_dict: dict, optimizer: Any,
                         lr_scheduler: Any, training_data: Any, collate_fn: Callable | None) -> tuple:
    """``initialize(model=PipelineModule)``: DeepSpeed's pipeline engine on deepshard.pipeline."""
    from .pipe_engine import PipelineEngine, pipeline_mesh

    if zero.built_under_init(model):
        raise ValueError("zero.Init() with a PipelineModule: not supported (pipelines train at ZeRO 0-1)")
    model.to(local_device())
    engine = PipelineEngine(model, cfg, ds_dict, mesh=pipeline_mesh(model))
    engine.lr_scheduler = client_scheduler(lr_scheduler, optimizer, engine.optimizer,
                                           config_scheduler="scheduler" in ds_dict)
    loader = None
    if training_data is not None:  # DeepSpeed's loader for a pipeline: this dp replica's share, in order
        from torch.utils.data import DataLoader, DistributedSampler

        dp = engine.mesh["dp"]  # shuffle=False: PipelineEngine._build_data_iter's sampler (unlike initialize's)
        sampler = DistributedSampler(training_data, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=False)
        loader = DataLoader(training_data, batch_size=cfg.micro_batch_size, sampler=sampler, collate_fn=collate_fn)
        engine.training_dataloader = loader
        engine.set_dataiterator(iter(utils.RepeatingLoader(loader)))
    return engine, engine.optimizer, loader, engine.lr_scheduler
