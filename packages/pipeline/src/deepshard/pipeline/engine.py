"""One training step of a pipeline whose stages are sharded by core's ZeRO (and TP).

Per step: gradient sync off -> ``schedule.step`` (every microbatch's forward and backward inside
torch.distributed.pipelining) -> sync on + ``finish_backward`` (stages 0/1 all-reduce once per
step; stage 2 already reduce-scattered each microbatch's buckets; FSDP2 stage 3 is reduced by the
schedule itself) -> ``ZeroOptimizer.step`` (the global-norm clip sums over the whole world, so
every pp stage and tp shard counts).  The loss is reported as the true global mean on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from deepshard.core import DeviceStateStore, EngineConfig, StateStore
from deepshard.core.dtensor_utils import local_tensor
from deepshard.core.memory import ModelStateBytes, model_state_memory
from deepshard.core.optim import StepStats, ZeroOptimizer, build_optimizer
from deepshard.core.parallelize import IGNORE_INDEX, ShardedPart
from deepshard.core.state_store import StoreFactory
from deepshard.core.step import (
    aux_loss_scale,
    count_valid_tokens,
    eval_mode,
    local_valid_tokens,
    loss_scale_factor,
    num_params,
    token_mean,
)
from deepshard.core.zero import CompositeStage, ZeroStage
from deepshard.pipeline.build import Pipeline

__all__ = ["CompositeStage", "PipelineStepResult", "PipelineEngine", "ShardedPart", "build_engine"]


@dataclass
class PipelineStepResult:
    loss: float  # summed token loss over all microbatches and dp replicas / their valid-token count
    stats: StepStats
    time_s: float  # wall time of the step on this rank


class PipelineEngine:
    """``engine.train_step(input_ids, labels)`` -> :class:`PipelineStepResult`.

    ``loss_fn`` (given to ``build_pipeline``) must return a microbatch's summed token loss over
    labels != -100; the engine divides by the step's global valid-token count.

    Every rank of a data-parallel replica passes the same batch (this replica's share of the
    global batch, ``microbatches`` x micro-batch size rows); only the first stage reads the inputs
    and only the last stage the labels.
    """

    model = None  # stage modules keep the full model's FQNs; the optimizer holds every param (see modules)

    def __init__(self, pipeline: Pipeline, optimizer: ZeroOptimizer, *, mesh: DeviceMesh, dtype: str = "fp32",
                 num_params: int | None = None) -> None:
        self.pipeline = pipeline
        self.optimizer = optimizer
        self.mesh = mesh
        self.dp_size = mesh["dp"].size()
        self.dp_group = mesh["dp"].get_group()
        self.dtype = dtype
        self.world = dist.get_world_size()
        self.loss_ranks = self.world // pipeline.pp_mesh.size()  # ranks holding the last stage
        self.num_params = self._rank_param_count() if num_params is None else num_params

    @property
    def modules(self) -> list[torch.nn.Module]:
        return self.pipeline.modules

    @property
    def zero(self) -> ZeroStage:
        return self.optimizer.stage

    @property
    def store(self) -> StateStore:
        return self.optimizer.store

    def _check_rows(self, input_ids: torch.Tensor) -> None:
        if input_ids.shape[0] % self.pipeline.microbatches:
            raise ValueError(f"batch of {input_ids.shape[0]} rows per dp rank does not split into "
                             f"pipeline.microbatches={self.pipeline.microbatches} (x train.grad_accum): make it "
                             f"a multiple")

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor, **model_kwargs: torch.Tensor
                         ) -> torch.Tensor:
        """Forward and backward of every microbatch in the batch, gradients reduced; returns the step's
        loss (summed token loss over the global batch / its valid-token count) on every rank.

        ``model_kwargs`` (e.g. ``doc_ids``) reach every stage's forward, split into microbatches as
        the inputs are."""
        p = self.pipeline
        self._check_rows(input_ids)
        device = p.stages[0].device
        # the step's valid-token count over every microbatch and dp replica, before any backward
        num_items = count_valid_tokens(local_valid_tokens(labels), group=self.dp_group, device=device)
        self.zero.set_grad_sync(False)  # reduce once per step, not once per microbatch
        scale = self.optimizer.scaler.scale
        p.loss.multiplier = loss_scale_factor(scale, group_size=self.dp_size, num_items=num_items)
        args = (input_ids,) if p.has_first else ()
        scaled: list[torch.Tensor] = []
        with aux_loss_scale(scale, micro_batches=p.microbatches):
            p.schedule.step(*args, target=labels if p.has_last else None, losses=scaled, return_outputs=False,
                            **model_kwargs)
        self.zero.set_grad_sync(True)
        self.optimizer.finish_backward()
        loss_sum = p.loss.true_sum(scaled) if p.has_last else torch.zeros((), device=device)
        dist.all_reduce(loss_sum)  # only last-stage ranks contribute (one collective; nccl needs device tensors)
        tp = self.loss_ranks // self.dp_size  # the tp ranks of a replica each hold the same loss
        return token_mean(loss_sum, num_items, copies=tp)

    def step(self) -> StepStats:
        """The optimizer step (clip, update, ZeRO's all-gather) over every stage this rank holds."""
        return self.optimizer.step()

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor, **model_kwargs: torch.Tensor
                   ) -> PipelineStepResult:
        """:meth:`forward_backward`, then :meth:`step`."""
        t0 = time.perf_counter()
        loss = self.forward_backward(input_ids, labels, **model_kwargs)
        stats = self.step()
        return PipelineStepResult(loss.item(), stats, time.perf_counter() - t0)

    @torch.no_grad()
    def loss_sum(self, input_ids: torch.Tensor, labels: torch.Tensor, **model_kwargs: torch.Tensor) -> torch.Tensor:
        """Forward only: this replica's summed token loss over ``labels != -100``, on every rank of
        the replica (the last stage's value, summed over the pp group where only it contributes)."""
        p = self.pipeline
        self._check_rows(input_ids)
        device = p.stages[0].device
        p.loss.multiplier = 1.0
        args = (input_ids,) if p.has_first else ()
        losses: list[torch.Tensor] = []
        with eval_mode(p.modules):
            p.schedule.eval(*args, target=labels if p.has_last else None, losses=losses, **model_kwargs)
        total = p.loss.true_sum(losses) if p.has_last else torch.zeros((), device=device)
        dist.all_reduce(total, group=p.pp_mesh.get_group())
        return total

    @torch.no_grad()
    def greedy_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Forward only: each row's most likely next token after its ``positions`` entry, on every rank
        of the replica (the last stage's answer, summed over the pp group where only it is non-zero)."""
        p = self.pipeline
        self._check_rows(input_ids)
        device = p.stages[0].device
        args = (input_ids,) if p.has_first else ()
        unlearned = torch.full_like(input_ids, IGNORE_INDEX)  # the schedule computes a loss on the last stage
        with eval_mode(p.modules):
            out = p.schedule.eval(*args, target=unlearned if p.has_last else None)
        tokens = torch.zeros(input_ids.shape[0], dtype=torch.int64, device=device)
        if p.has_last:
            rows = torch.arange(out.shape[0], device=out.device)
            tokens = out[rows, positions.to(out.device)].float().argmax(-1).to(device)
        dist.all_reduce(tokens, group=p.pp_mesh.get_group())
        return tokens

    def local_param_numel(self) -> int:
        """Elements of the parameters this rank holds right now (local shards)."""
        return sum(local_tensor(q.data).numel() for m in self.pipeline.modules for q in m.parameters())

    def _rank_param_count(self) -> int:
        """Ψ of the README's ZeRO table for this rank: its stages' parameters after TP, before dp sharding."""
        return num_params(self.zero.params, shards=self.dp_size if self.zero.zero_stage == 3 else 1)

    def memory(self) -> dict[str, ModelStateBytes]:
        """Measured and expected per-rank model-state bytes (as ``Engine.memory``)."""
        return model_state_memory(self.zero, self.store, num_params=self.num_params, dp=self.dp_size,
                                  dtype=self.dtype, modules=self.pipeline.modules)


def build_engine(pipeline: Pipeline, config: EngineConfig, *, mesh: DeviceMesh,
                 store_factory: StoreFactory = DeviceStateStore, tied: Sequence[tuple[str, str]] = ()
                 ) -> PipelineEngine:
    """Optimizer, loss scaler and LR schedule over the ZeRO stages ``parallelize_fn`` returned.

    ``tied``: ``(kept, copy)`` names of parameters the split left on two stages (a tied head: see
    :mod:`deepshard.pipeline.tied`); with more than one stage their gradients are summed each step.

    ``config.ac`` is the parallelize_fn's business (it wraps blocks); ``config.grad_accum`` is the
    caller's: a step's accumulation is the schedule's microbatches (build the pipeline with
    ``microbatches x grad_accum`` of them), so the engine steps once per ``train_step``.
    """
    parts = [h if isinstance(h, ShardedPart) else ShardedPart(h) for h in pipeline.handles]
    if not all(isinstance(p.zero, ZeroStage) for p in parts):
        raise ValueError("build_engine(): parallelize_fn must return a ZeroStage or ShardedPart per stage module")
    zero = parts[0].zero if len(parts) == 1 else CompositeStage([p.zero for p in parts])
    masters = [t for p in parts for t in p.fp32_masters] if all(p.fp32_masters is not None for p in parts) else None
    optimizer = build_optimizer(zero, config, store_factory=store_factory, fp32_masters=masters)
    counted = [p.num_params for p in parts]
    num_params = sum(counted) if None not in counted else None
    if tied and pipeline.num_stages > 1:
        from deepshard.pipeline.tied import TiedPipelineEngine

        return TiedPipelineEngine(pipeline, optimizer, mesh=mesh, dtype=config.precision.dtype,
                                  num_params=num_params, tied=tied)
    return PipelineEngine(pipeline, optimizer, mesh=mesh, dtype=config.precision.dtype, num_params=num_params)
