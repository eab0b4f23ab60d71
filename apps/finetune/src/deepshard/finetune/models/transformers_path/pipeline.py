"""Pipeline parallelism (``parallel.pp``) on the transformers path: the pipeline package's split, on a
view of transformers' model whose parts it names by the config's own ``base_model_pp_plan``.

The split cuts the model's one block ``ModuleList``: the first stage keeps what the plan lists before
the blocks (the input embedding), the last what it lists after them (the final norm) and the head;
every stage keeps the rotary embedding (a buffer), so transformers' own base-model forward runs on
each stage, from ``input_ids`` on the first and from ``inputs_embeds`` (the previous stage's hidden
states) on the others; a part a stage does not own is ``nn.Identity`` there.  Parameter names stay
those of the unsplit model (``hf.<base>.layers.<i>...``): checkpoints and the export read them as is.

Only architectures whose base-model forward iterates its blocks (not ``layers[:n]``, which a
stage's ``StageLayers`` cannot slice) and was checked against plain torch run: GPT-NeoX.  Others,
tied embeddings, and pp with tp are refused before start (:func:`check_pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deepshard.core.config import EngineConfig
from deepshard.core.mesh import local_device
from deepshard.core.parallelize import IGNORE_INDEX, ShardedPart, parallelize_model
from deepshard.core.state_store import DeviceStateStore, StoreFactory
from deepshard.core.zero import ParamOffload
from deepshard.finetune.models.transformers_path.model import (
    TransformersConfig,
    TransformersLM,
    hf_config_object,
    positions_in_documents,
)
from deepshard.pipeline import DecoderSpec, PipelineEngine, build_engine, build_pipeline

TESTED = ("GPTNeoXForCausalLM",)  # base forward iterates self.layers; equal to plain torch (tests/models)
LAYERS, HEAD = "pp_layers", "pp_head"


def check_pipeline(cfg: TransformersConfig, *, pp: int, tp: int = 1) -> None:
    """ValueError, before start, unless this path can split ``cfg``'s model into ``pp`` stages."""
    if pp <= 1:
        return
    if cfg.arch not in TESTED:
        raise ValueError(f"parallel.pp={pp}: the transformers path splits {list(TESTED)} only ({cfg.arch} is "
                         f"untested: its base model must iterate one block ModuleList from inputs_embeds); "
                         f"use parallel.pp=1")
    if cfg.tie_embeddings:
        raise ValueError(f"parallel.pp={pp}: {cfg.arch} ties its head to its embedding (tie_word_embeddings), "
                         f"which would live on different stages; use parallel.pp=1")
    if tp > 1:
        raise ValueError(f"parallel.pp={pp} with parallel.tp={tp}: the transformers path's stages are not "
                         f"tensor-parallel (untested); use tp=1 with pp")


class PipelineView(nn.Module):
    """transformers' model (``model.hf``, the same modules) with the parts the split moves named at the
    top: ``pp_first_<name>`` / ``pp_last_<name>`` for the base model's plan entries around its blocks,
    :data:`LAYERS` and :data:`HEAD`.  Setting a first/last part to None leaves an ``nn.Identity``."""

    def __init__(self, model: TransformersLM) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.hf = model.hf
        base = self.hf.base_model_prefix
        plan = list(hf_config_object(model.cfg).base_model_pp_plan)
        cut = plan.index("layers")
        head = next(n for n, m in self.hf.named_modules() if m is self.hf.get_output_embeddings())
        alias = {f"pp_first_{n}": (base, n) for n in plan[:cut]} | {f"pp_last_{n}": (base, n) for n in plan[cut + 1:]}
        alias |= {LAYERS: (base, "layers"), HEAD: ("", head)}
        self.__dict__["_alias"] = alias
        self.spec = DecoderSpec(layers=LAYERS, first=tuple(f"pp_first_{n}" for n in plan[:cut]),
                                last=(*[f"pp_last_{n}" for n in plan[cut + 1:]], HEAD))

    def __getattr__(self, name: str) -> Any:
        alias = self.__dict__.get("_alias", {})
        if name in alias:
            parent, attr = alias[name]
            return getattr(self.hf.get_submodule(parent), attr)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        alias = self.__dict__.get("_alias", {})
        if name not in alias:
            return super().__setattr__(name, value)
        parent, attr = alias[name]
        if value is None and name.startswith(("pp_first_", "pp_last_")):
            value = nn.Identity()  # the base forward calls it: a stage that does not own it passes through
        setattr(self.hf.get_submodule(parent), attr, value)

    @property
    def blocks(self) -> list[nn.Module]:
        return list(getattr(self, LAYERS))

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids on the first stage, the previous stage's hidden states elsewhere; logits on the last."""
        base = getattr(self.hf, self.hf.base_model_prefix)
        first = not x.is_floating_point()
        kwargs: dict[str, Any] = {"input_ids": x} if first else {"inputs_embeds": x}
        if doc_ids is not None:  # positions restart per document: transformers masks packed sequences by them
            kwargs["position_ids"] = positions_in_documents(doc_ids)
        h = base(**kwargs, use_cache=False).last_hidden_state
        head = getattr(self, HEAD)
        return head(h) if head is not None else h


def pipeline_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The last stage's summed token loss over labels != -100 (the engine divides by the global count)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def stage_init(seed: int = 0, *, full: Callable[[], nn.Module] | None = None) -> Callable[[nn.Module], None]:
    """``init_fn`` of the split: each stage copies its parameters and buffers, by name, from the full
    model as the engine path loads it (``full``: built once per rank, lazily)."""
    del seed  # every parameter comes from the checkpoint
    assert full is not None, "the transformers path's stages copy the loaded model (full=...)"
    cache: dict[str, nn.Module] = {}

    def init(stage: nn.Module) -> None:
        if "full" not in cache:
            cache["full"] = full()
        whole = cache["full"]
        params = dict(whole.named_parameters(remove_duplicate=False))
        buffers = dict(whole.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, p in stage.named_parameters():
                p.copy_(params[name])
            for name, b in stage.named_buffers():
                b.copy_(buffers[name])

    return init


def pipeline_transformers(model: TransformersLM, mesh: DeviceMesh, config: EngineConfig, *,
                          schedule: str = "1f1b", microbatches: int = 1, partition: str = "uniform",
                          virtual_stages: int | None = None, init_fn: Callable[[nn.Module], None] | None = None,
                          store_factory: StoreFactory = DeviceStateStore, offload_params: ParamOffload | None = None,
                          device: torch.device | None = None) -> PipelineEngine:
    """Split ``model`` (on meta) into ``mesh["pp"]`` stages, core's recipe (AC, ZeRO) on each stage's
    blocks, and the pipeline engine (``train_step(input_ids, labels)``)."""
    check_pipeline(model.cfg, pp=mesh["pp"].size(), tp=mesh["tp"].size())
    view = PipelineView(model)

    def parallelize(stage: nn.Module) -> ShardedPart:
        return parallelize_model(stage, mesh, zero=config.zero, dtype=config.precision.dtype, ac=config.ac,
                                 blocks=stage.blocks, offload_params=offload_params, ac_offload=config.ac_offload,
                                 compile=config.compile)

    pipe = build_pipeline(view, mesh["pp"], loss_fn=pipeline_loss, schedule=schedule, microbatches=microbatches,
                          partition=partition, virtual_stages=virtual_stages, parallelize_fn=parallelize,
                          init_fn=init_fn, spec=view.spec, device=device or local_device())
    return build_engine(pipe, config, mesh=mesh, store_factory=store_factory)
