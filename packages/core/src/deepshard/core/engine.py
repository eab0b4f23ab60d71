"""``initialize(model, config)``: a thin composition of mesh, the parallelize recipe, optimizer.

The engine owns no training logic beyond micro-step bookkeeping; every part is usable alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deepshard.core.config import EngineConfig
from deepshard.core.memory import ModelStateBytes, model_state_memory
from deepshard.core.mesh import ParallelDims, build_mesh, init_distributed, local_device, zero_mesh
from deepshard.core.optim import StepStats, ZeroOptimizer, build_optimizer
from deepshard.core.parallelize import ShardedPart, parallelize_model
from deepshard.core.precision import LossScaler
from deepshard.core.state_store import DeviceStateStore, StateStore, StoreFactory
from deepshard.core.step import aux_loss_scale, count_valid_tokens, loss_scale_factor, num_params
from deepshard.core.zero import ParamOffload, ZeroStage
from deepshard.core.zero.hsdp import hsdp_mesh


class Engine:
    """``loss = engine(batch)``, ``engine.backward(loss)``, ``engine.step()``."""

    def __init__(self, model: nn.Module, stage: ZeroStage, optimizer: ZeroOptimizer, config: EngineConfig,
                 mesh: DeviceMesh, num_params: int) -> None:
        self.model = model
        self.stage = stage
        self.optimizer = optimizer
        self.config = config
        self.mesh = mesh
        self.num_params = num_params
        self.micro_step = 0
        self.last_stats: StepStats | None = None

    @property
    def modules(self) -> list[nn.Module]:
        return [self.model]

    @property
    def scaler(self) -> LossScaler:
        return self.optimizer.scaler

    @property
    def store(self) -> StateStore:
        return self.optimizer.store

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def _is_boundary(self) -> bool:
        return (self.micro_step + 1) % self.config.grad_accum == 0

    def global_num_items(self, local_count: int | torch.Tensor) -> torch.Tensor:
        """This step's valid-label count (labels != -100 over all its micro-batches on this rank),
        summed over the ZeRO group (dp, or ``dp x sp``: each sp rank counts its slice of the
        sequences): the ``num_items`` of :meth:`backward` (:func:`~deepshard.core.step.count_valid_tokens`).
        Call it once per step, before the first backward."""
        return count_valid_tokens(local_count, group=zero_mesh(self.mesh).get_group(), device=local_device())

    def backward(self, loss: torch.Tensor, *, num_items: torch.Tensor | float | None = None) -> None:
        """Backpropagate one micro-batch; reduce only on the accumulation boundary where allowed.

        Two contracts:

        - ``num_items`` given (recommended): ``loss`` is the micro-batch's *summed* token loss
          (``reduction="sum"``) and ``num_items`` the step's global valid-token count from
          :meth:`global_num_items`.  The step's gradient is then that of the sum over the global
          batch divided by the global count, whatever the layout of micro-batches and ranks.
        - ``num_items=None`` (DeepSpeed's contract): ``loss`` is the micro-batch's mean; it is
          divided by ``grad_accum`` and ranks are averaged: a mean of means, exact only when every
          micro-batch holds the same number of valid tokens.

        Extra loss terms the forward attached (:func:`~deepshard.core.step.add_aux_loss`) get their
        gradient here too, under either contract.
        """
        self.stage.set_grad_sync(self._is_boundary())
        scale, accum = self.scaler.scale, self.config.grad_accum
        factor = loss_scale_factor(scale, group_size=zero_mesh(self.mesh).size(), num_items=num_items,
                                   micro_batches=accum, device=loss.device)
        with aux_loss_scale(scale, micro_batches=accum):
            (loss * factor).backward()
        self.optimizer.finish_backward()
        self.micro_step += 1

    def step(self) -> StepStats | None:
        """The optimizer step on accumulation boundaries (None between them)."""
        if self.micro_step % self.config.grad_accum:
            return None
        self.last_stats = self.optimizer.step()
        return self.last_stats

    def gather_params(self) -> None:
        """Every parameter holds its updated value (``zero.overlap_allgather`` leaves the all-gather of
        stages 1-2 running into the next forward: call this before reading params directly)."""
        self.stage.gather_params()

    def memory(self) -> dict[str, ModelStateBytes]:
        """Measured and expected per-rank model-state bytes."""
        hsdp = hsdp_mesh(self.mesh)  # HSDP shards over dp_shard only; the dp_replicate groups hold copies
        shards = hsdp["dp_shard"].size() if hsdp is not None else zero_mesh(self.mesh).size()
        return model_state_memory(self.stage, self.store, num_params=self.num_params, dp=shards,
                                  dtype=self.config.precision.dtype, modules=[self.model])


def initialize(
    model: nn.Module,
    config: EngineConfig,
    *,
    mesh: DeviceMesh | None = None,
    blocks: Sequence[nn.Module] | None = None,
    parallelize_fn: Callable[[nn.Module], ShardedPart] | None = None,
    store_factory: StoreFactory = DeviceStateStore,
    offload_params: ParamOffload | None = None,
    materialize: Callable[[nn.Module], None] | None = None,
) -> Engine:
    """Parallelize ``model`` (fp32, on its device) and build its optimizer.

    ``parallelize_fn(model)`` applies the model family's recipe (the app's ``parallelize_llama``:
    TP, activation checkpointing, precision, ZeRO, through :func:`parallelize_model`); without it,
    :func:`parallelize_model` runs from ``config`` over ``blocks`` (default ``model.layers``) with
    no TP plan.  ``mesh`` defaults to a pure data-parallel mesh over all ranks (a 1-rank group is
    started when none exists).  ``store_factory`` decides where optimizer state lives.  A ``model``
    built on the meta device (stage 3: no rank ever holds the whole model, DeepSpeed's zero.Init)
    is moved to the device after sharding and initialized by ``materialize(model)``.
    """
    if mesh is None:
        init_distributed()
        mesh = build_mesh(ParallelDims())
    stage_num = config.zero.stage
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and (stage_num != 3 or materialize is None):
        raise ValueError(f"zero.stage={stage_num}: a model on the meta device needs zero.stage=3 and a "
                         f"materialize function (stages 0-2 keep full replicated params)")
    if parallelize_fn is None:
        parallelize_fn = partial(parallelize_model, mesh=mesh, zero=config.zero, dtype=config.precision.dtype,
                                 ac=config.ac, blocks=blocks, offload_params=offload_params,
                                 ac_offload=config.ac_offload, compile=config.compile)
    part = parallelize_fn(model)
    if on_meta:
        device = local_device()
        model.to_empty(device="cpu" if offload_params is not None else device)
        if offload_params is not None:  # FSDP2 brings offloaded params to the device per all-gather, never buffers (RoPE)
            for module in model.modules():
                module._buffers.update({k: b.to(device) for k, b in module._buffers.items() if b is not None})
        with torch.no_grad():
            materialize(model)
    optimizer = build_optimizer(part.zero, config, store_factory=store_factory, fp32_masters=part.fp32_masters)
    psi = part.num_params
    if psi is None:
        psi = num_params(part.zero.params, shards=zero_mesh(mesh).size() if stage_num == 3 else 1)
    return Engine(model, part.zero, optimizer, config, mesh, psi)
