"""DeepSpeed's ``PipelineEngine`` calls (``train_batch`` / ``eval_batch``) on ``deepshard.pipeline``.

``initialize(model=PipelineModule(...))`` builds a (pp=num_stages, dp=rest) mesh, splits the layers
with ``deepshard.pipeline.build_pipeline`` (the ``parallelize_fn`` is core's ``parallelize_model``)
and trains them with ``build_engine``'s optimizer.  DeepSpeed's loss contract is kept: a batch is
``gradient_accumulation_steps`` micro-batches pulled from ``data_iter`` (on the first and last
stages only, as DeepSpeed does), each micro-batch's ``loss_fn`` is a mean, the gradient is that of
their mean averaged over dp ranks, and ``train_batch`` returns that mean on every rank.  Tied
layers (``TiedLayerSpec``) on several stages get their gradients summed over those stages before
the update (DeepSpeed's tied-weight all-reduce), so their copies stay equal.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deepshard.core.mesh import ParallelDims, build_mesh, local_device
from deepshard.core.optim import StepStats
from deepshard.core.parallelize import parallelize_model
from deepshard.core.step import aux_loss_scale, eval_mode, loss_scale_factor
from deepshard.pipeline import DecoderSpec, build_engine, build_pipeline

from .config import CompatConfig
from .pipe import PipelineModule, TiedLayer
from .queries import DeepSpeedQueries
from .schedule import step_scheduler

_SPEC = DecoderSpec(layers="layers", first=(), last=())  # a PipelineModule is its layers, nothing around them


def _retie(stage: nn.Module) -> None:
    """Occurrences of one tied key on a stage share one module again (the split copied each layer)."""
    first: dict[str, nn.Module] = {}
    for layer in stage.modules():
        if isinstance(layer, TiedLayer):
            layer.module = first.setdefault(layer.key, layer.module)


def _tied_groups(model: PipelineModule, ranges: list[range], mesh: Any) -> dict[str, Any]:
    """For each tied key held by several stages: the group of this rank and its peers (same dp index)
    on the other stages holding it.  Every rank creates every group, in the same order."""
    ranks = mesh.mesh  # (pp, dp, tp) global ranks
    me = dist.get_rank()
    groups: dict[str, Any] = {}
    for key in model.tied_keys():
        stages = [s for s, r in enumerate(ranges)
                  if any(isinstance(model.layers[i], TiedLayer) and model.layers[i].key == key for i in r)]
        if len(stages) < 2:
            continue
        for d in range(ranks.shape[1]):
            members = [int(ranks[s, d, 0]) for s in stages]
            group = dist.new_group(members)
            if me in members:
                groups[key] = group
    return groups


def _batch(data_iter: Any, n: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``n`` micro-batches ``(inputs, labels)`` as one batch (the schedule splits it again)."""
    inputs, labels = [], []
    for _ in range(n):
        x, y = next(data_iter)
        inputs.append(x if isinstance(x, (tuple, list)) else (x,))
        labels.append(y)
    device = local_device()
    args = tuple(torch.cat([xs[j] for xs in inputs]).to(device) for j in range(len(inputs[0])))
    return args, torch.cat(labels).to(device)


class PipelineEngine(nn.Module, DeepSpeedQueries):
    """What DeepSpeed scripts call on a pipeline ``model_engine`` (DeepSpeed's config queries from
    :class:`DeepSpeedQueries`, as its PipelineEngine inherits them from its DeepSpeedEngine)."""

    def __init__(self, model: PipelineModule, config: CompatConfig, ds_config: dict, *, mesh: Any) -> None:
        super().__init__()
        zero = config.engine.zero
        if zero.stage > 1:
            raise ValueError(f"zero_optimization.stage={zero.stage} with a PipelineModule: not supported (DeepSpeed "
                             f"refuses ZeRO-2/3 with pipeline parallelism too); use stage 0 or 1")
        if model.loss_fn is None:
            raise ValueError("PipelineModule(loss_fn=None): train_batch needs loss_fn(outputs, labels)")
        self.compat, self.config, self.mesh = config, dict(ds_config), mesh
        self.micro_batches = config.grad_accum
        self.global_steps = 0
        self.last_stats: StepStats | None = None
        self.lr_scheduler: Any = None
        self.training_dataloader: Any = None
        self.data_iterator: Any = None  # over training_dataloader, repeated (DeepSpeed's default data_iter)
        for p in model.parameters():  # every stage starts from rank 0's build (tied copies equal)
            dist.broadcast(p.data, src=0)

        def parallelize(stage: nn.Module) -> Any:
            _retie(stage)
            return parallelize_model(stage, mesh, zero=zero, dtype=config.engine.precision.dtype,
                                     blocks=nn.ModuleList())

        num_stages = mesh["pp"].size()
        schedule = "1f1b" if self.micro_batches >= num_stages else "gpipe"  # same math; 1F1B needs >= pp
        self.pipeline = build_pipeline(model, mesh["pp"], loss_fn=model.loss_fn, schedule=schedule,
                                       microbatches=self.micro_batches, partition=model.partition_method,
                                       parallelize_fn=parallelize, spec=_SPEC, device=local_device())
        self.engine = build_engine(self.pipeline, config.engine, mesh=mesh)
        self.module = self.pipeline.modules[0]
        self.tied = _tied_groups(model, self.pipeline.ranges, mesh)
        self._count_tied_once()

    def _count_tied_once(self) -> None:
        """The gradient norm (clipping, ``get_global_grad_norm``) counts a tied weight once, as DeepSpeed
        does: each of the ``k`` stages holding its (summed, equal) gradient contributes ``1/k``."""
        holders = {i: dist.get_world_size(group) for i, group in self._tied_indices()}
        if holders:
            self.engine.optimizer.count_shared(holders)

    def _tied_indices(self) -> list[tuple[int, Any]]:
        """(index in the stage's params, group) of every tied weight shared with another stage."""
        index = {id(q): i for i, q in enumerate(self.engine.zero.params)}
        found: dict[int, Any] = {}
        for layer in self.module.modules():
            if isinstance(layer, TiedLayer) and layer.key in self.tied:
                for attr in layer.attrs:
                    i = index.get(id(getattr(layer.module, attr)))
                    if i is not None:
                        found.setdefault(i, self.tied[layer.key])
        return list(found.items())

    # --- DeepSpeed's queries
    def is_first_stage(self) -> bool:
        return self.pipeline.has_first

    def is_last_stage(self) -> bool:
        return self.pipeline.has_last

    @property
    def stage_id(self) -> int:
        return self.pipeline.stage_ids[0]

    @property
    def num_stages(self) -> int:
        return self.pipeline.num_stages

    @property
    def optimizer(self) -> Any:
        return self.engine.optimizer

    # --- DeepSpeed's pipeline calls
    def _mean_over_replicas(self, value: torch.Tensor) -> torch.Tensor:
        """The last stage's value averaged over dp, then on every pp stage (DeepSpeed's broadcast)."""
        dist.all_reduce(value, group=self.mesh["dp"].get_group())
        value /= self.mesh["dp"].size()
        dist.all_reduce(value, group=self.mesh["pp"].get_group())  # only the last stage is non-zero
        return value

    def set_dataiterator(self, iterator: Any) -> None:
        """DeepSpeed's: the iterator ``train_batch()`` / ``eval_batch()`` read when given none."""
        self.data_iterator = iterator

    def _run(self, data_iter: Any, *, train: bool) -> torch.Tensor:
        p, n = self.pipeline, self.micro_batches
        data_iter = data_iter if data_iter is not None else self.data_iterator
        if data_iter is None and (p.has_first or p.has_last):
            raise ValueError("train_batch()/eval_batch(): no data_iter given and no training_data= given to "
                             "deepspeed.initialize (pass data_iter=iter(RepeatingLoader(loader)))")
        args, labels = _batch(data_iter, n) if (p.has_first or p.has_last) else ((), None)
        losses: list[torch.Tensor] = []
        inputs = args if p.has_first else ()
        target = labels if p.has_last else None
        if train:
            self.engine.zero.set_grad_sync(False)  # reduce once per batch, not once per micro-batch
            scale = self.engine.optimizer.scaler.scale  # DeepSpeed's contract: a mean of micro-batch means
            p.loss.multiplier = loss_scale_factor(scale, group_size=self.mesh["dp"].size(), micro_batches=n)
            for m in p.modules:
                m.train()
            with aux_loss_scale(scale, micro_batches=n):
                p.schedule.step(*inputs, target=target, losses=losses, return_outputs=False)
            self.engine.zero.set_grad_sync(True)
            self.engine.optimizer.finish_backward()
        else:
            p.loss.multiplier = 1.0 / n
            with torch.no_grad(), eval_mode(p.modules):
                p.schedule.eval(*inputs, target=target, losses=losses)
        device = local_device()
        total = (torch.stack([t.detach().float() for t in losses]).sum() / p.loss.multiplier / n if p.has_last
                 else torch.zeros((), device=device))
        return self._mean_over_replicas(total.to(device))

    def _sum_tied_grads(self) -> None:
        grads = self.engine.zero.local_grads()  # views of the reducers' buckets (ZeRO 0-1): summed in place
        for i, group in self._tied_indices():
            dist.all_reduce(grads[i], group=group)

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """One update over ``gradient_accumulation_steps`` micro-batches; the mean loss on every rank."""
        loss = self._run(data_iter, train=True)
        self._sum_tied_grads()
        stats = self.last_stats = self.engine.step()
        self.global_steps += 1
        if stats.applied and getattr(self.lr_scheduler, "optimizer", None) is not None:
            step_scheduler(self.lr_scheduler)
        return loss

    def eval_batch(self, data_iter: Any, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None
                   ) -> torch.Tensor:
        """The mean loss of ``gradient_accumulation_steps`` micro-batches, averaged over dp, on every rank."""
        if return_logits or not compute_loss or reduce_output != "avg" or not bcast_loss:
            raise ValueError("eval_batch(): only the default (compute_loss=True, reduce_output='avg', bcast_loss=True, "
                             "no logits) is supported")
        if num_micro_batches not in (None, self.micro_batches):
            raise ValueError(f"eval_batch(num_micro_batches={num_micro_batches}): the schedule was built for "
                             f"{self.micro_batches} micro-batches (gradient_accumulation_steps)")
        return self._run(data_iter, train=False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("Only train_batch() is accessible in pipeline mode (as in DeepSpeed); eval_batch() "
                         "for evaluation")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("Only train_batch() is accessible in pipeline mode (as in DeepSpeed)")

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("Only train_batch() is accessible in pipeline mode (as in DeepSpeed)")

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("save_checkpoint() with a PipelineModule: not supported yet; DeepSpeed's per-layer files "
                         "are not written here (use deepshard.pipeline with the app's checkpointing)")

    load_checkpoint = save_checkpoint


def pipeline_mesh(model: PipelineModule) -> Any:
    world = dist.get_world_size()
    if world % model.num_stages:
        raise ValueError(f"PipelineModule(num_stages={model.num_stages}): does not divide the world size {world}")
    return build_mesh(ParallelDims(pp=model.num_stages, dp=world // model.num_stages))

