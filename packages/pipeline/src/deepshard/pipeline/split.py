"""Cut a decoder into stage modules, torchtitan's ``pipeline_llama`` way.

A stage module is a copy of the full model's skeleton that keeps only its own layers; the input
modules (embedding) exist only on the first stage and the output modules (final norm, head) only
on the last, the others set to None (the model's forward treats a missing embedding as "input is
hidden states" and a missing head as "return hidden states").

The owned layers sit in a :class:`StageLayers` (a ModuleDict keyed by the *original* layer
index), so every parameter keeps its full-model FQN (``layers.5.mlp.up_proj.weight`` on the
stage that owns layer 5): checkpoints saved under any pipeline split load under any other.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["DecoderSpec", "StageLayers", "split_model"]


@dataclass(frozen=True)
class DecoderSpec:
    """Where a decoder keeps its parts (HF/torchtitan names by default)."""

    layers: str = "layers"
    first: tuple[str, ...] = ("embed_tokens",)
    last: tuple[str, ...] = ("norm", "lm_head")


class StageLayers(nn.ModuleDict):
    """The layers a stage owns, keyed by their index in the full model, iterated in order.

    Iterating yields the layers themselves (not keys, as a plain ModuleDict would), so a forward
    written ``for layer in self.layers`` runs unchanged on a stage.
    """

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


def _detach_children(model: nn.Module, names: Sequence[str]) -> dict[str, nn.Module | None]:
    saved = {n: getattr(model, n) for n in names}
    for n in names:
        setattr(model, n, None)
    return saved


def split_model(
    model: nn.Module,
    ranges: Sequence[range],
    stage_ids: Sequence[int],
    *,
    spec: DecoderSpec | None = None,
    device: torch.device | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> list[nn.Module]:
    """One module per stage in ``stage_ids`` (indices into ``ranges``, the layer range of every stage).

    ``model`` is either materialized (its values are copied: stage weights equal the full
    model's) or on the meta device: then each stage is ``to_empty(device)`` and ``init_fn(stage)``
    must fill parameters *and* buffers.  Only the owned parts are ever copied, so a real model
    costs its own size plus the owned parts, never two full copies.
    """
    spec = spec or DecoderSpec()
    layers = getattr(model, spec.layers)
    num_stages = len(ranges)
    on_meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    if on_meta and init_fn is None:
        raise ValueError("split_model(): a meta-device model needs init_fn to fill the stage weights")
    _check_no_shared_params(model, spec, num_stages)
    parts = list(spec.first) + list(spec.last) + [spec.layers]
    saved = _detach_children(model, parts)
    try:
        skeleton = copy.deepcopy(model)  # buffers (e.g. RoPE tables) and config, no weights
    finally:
        for n, m in saved.items():
            setattr(model, n, m)
    stages = []
    for sid in stage_ids:
        stage = copy.deepcopy(skeleton)
        owned = StageLayers({str(i): copy.deepcopy(layers[i]) for i in ranges[sid]})
        setattr(stage, spec.layers, owned)
        for n in spec.first:
            setattr(stage, n, copy.deepcopy(saved[n]) if sid == 0 else None)
        for n in spec.last:
            setattr(stage, n, copy.deepcopy(saved[n]) if sid == num_stages - 1 else None)
        if on_meta:
            stage.to_empty(device=device or torch.device("cpu"))
            with torch.no_grad():
                init_fn(stage)
        elif device is not None:
            stage.to(device)
        stages.append(stage)
    return stages


def _check_no_shared_params(model: nn.Module, spec: DecoderSpec, num_stages: int) -> None:
    """A parameter shared by the first and last stages needs a copy on each and a cross-stage gradient sum
    (``deepshard.pipeline.tied``: ``untie`` the model, then ``build_engine(..., tied=pairs)``); refused here
    with more than one stage, so a model passed without that never trains two copies apart."""
    if num_stages == 1:
        return
    first = {id(p) for n in spec.first if getattr(model, n) is not None for p in getattr(model, n).parameters()}
    last = {id(p) for n in spec.last if getattr(model, n) is not None for p in getattr(model, n).parameters()}
    if first & last:
        raise ValueError("model.tie_embeddings=True with parallel.pp > 1: the embedding and the head would "
                         "live on different stages; give the head its own copy (deepshard.pipeline.tied.untie) "
                         "and sum the copies' gradients (build_engine(..., tied=pairs)), or use pp=1")
