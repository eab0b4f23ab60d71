"""``deepspeed.initialize(model=, config=)`` with no optimizer: a model for forward passes only.

What TRL's ``prepare_deepspeed`` builds for a reference model (DPO's, GRPO's with ``beta > 0``): the
trainer's ds_config without its optimizer, scheduler and optimizer offload, at stage 0 (a full replica on
each rank) unless the policy trains at ZeRO-3 (then the reference is sharded the same way, parameters
all-gathered per block in each forward).  DeepSpeed returns its engine with no optimizer; here that is
:class:`InferenceEngine`: no gradients are reduced and nothing is stepped, so no optimizer state exists.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deepshard.core.mesh import ParallelDims, build_mesh, local_device, zero_mesh
from deepshard.core.precision import DTYPES
from deepshard.core.zero import ParamOffload, apply_fsdp

from . import zero
from .checkpoint import full_state_dict
from .config import CompatConfig
from .queries import ModuleAttributes, RankQueries


class InferenceEngine(ModuleAttributes, nn.Module, RankQueries):
    """The engine DeepSpeed returns without an optimizer: ``engine(batch)`` (under ``torch.no_grad()`` at
    ZeRO-3 the gathered units are released after each forward, as DeepSpeed does), ``.module``, ``eval()``;
    training calls stop with one line."""

    def __init__(self, module: nn.Module, ds_config: dict, stage: int) -> None:
        super().__init__()
        self.module = module
        self.config = dict(ds_config)
        self.stage = stage
        self.optimizer = None
        self.lr_scheduler = None

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size()

    def zero_optimization_stage(self) -> int:
        return self.stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        if self.stage == 3 and not torch.is_grad_enabled():
            from .engine import release_gathered

            release_gathered(self.module)
        return out

    def train(self, mode: bool = True) -> InferenceEngine:
        self.module.train(mode)
        return self

    def eval(self) -> InferenceEngine:
        return self.train(False)

    def backward(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("engine.backward(): this engine was initialized without an optimizer (forward only); pass "
                         "optimizer= or add an optimizer section to the ds_config to train it")

    def step(self, *args: Any, **kwargs: Any) -> None:
        self.backward()

    def destroy(self) -> None:
        """DeepSpeed's ``engine.destroy()`` (accelerate's ``free_memory()`` calls it, e.g. from ``Trainer.train()``
        after an ``evaluate()``): nothing to release here, no save is ever in flight."""

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        return full_state_dict(self.module, exclude_frozen=exclude_frozen_parameters)



def initialize_inference(model: nn.Module, cfg: CompatConfig, ds_dict: dict, *, blocks: nn.ModuleList,
                         offload_params: ParamOffload | None) -> InferenceEngine:
    """Place (stages 0-2: replicated on the compute device, in the compute dtype) or shard (stage 3, built
    under ``zero.Init`` or not) ``model`` for forward passes; nothing for an optimizer is allocated."""
    stage = cfg.engine.zero.stage
    dtype = DTYPES[cfg.engine.precision.dtype]
    on_meta = zero.built_under_init(model)
    if on_meta and stage != 3:
        raise ValueError(f"zero.Init() needs zero_optimization.stage=3 (the ds_config has stage {stage})")
    if stage != 3:
        if offload_params is not None:
            raise ValueError(f"zero_optimization.offload_param needs stage 3 (the ds_config has stage {stage})")
        model.to(device=local_device(), dtype=dtype)
        return InferenceEngine(model, ds_dict, stage)
    if not on_meta and offload_params is None:
        model.to(local_device())
    zero.check_external_parameters(model, blocks)
    apply_fsdp(model, blocks, zero_mesh(build_mesh(ParallelDims())), param_dtype=dtype, reduce_dtype=dtype, reshard_after_forward=True,
               offload_params=offload_params, prefetch=1)
    if on_meta:
        device = local_device()
        model.to_empty(device="cpu" if offload_params is not None else device)
        if offload_params is not None:  # buffers (RoPE) live on the compute device; FSDP2 moves only params
            for module in model.modules():
                module._buffers.update({k: b.to(device) for k, b in module._buffers.items() if b is not None})
        with torch.no_grad():
            zero.materialize(model)
    zero.tag_zero3_params(model)
    zero.fsdp_lazy_init(model)
    return InferenceEngine(model, ds_dict, stage)
