"""The model families behind one seam (torchtitan's ``ModelSpec``), so that the config, the run's
assembly, the exporters and the estimator name no family: they ask the registry for the family of a
config (``spec_of``), of a HF ``config.json`` (``for_hf``) or of a checkpoint's manifest (``from_meta``).

A family lives in its own package, ``models/<family>/``, whose ``__init__`` registers its spec;
the families built in here (``BUILTIN``) are imported the first time the registry is asked, so
importing the registry alone costs nothing.  Generic machinery (attention, LoRA, tiling, Ulysses,
the memory plan) stays in ``models/`` and reaches a family through its spec.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepshard.finetune.models.hf import check_hf_dir, from_hf_name, load_hf_weights, to_hf_name

BUILTIN = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "phi3", "gemma",
           "transformers_path", "qwen2_moe")  # packages under deepshard.finetune.models that register a family on import
DEFAULT_FAMILY = "llama"  # the presets' (model=tiny|small) family: its config's fields are the model.* keys


@dataclass(frozen=True)
class HFAdapter:
    """How a family meets HF transformers' checkpoints: config.json both ways, parameter names, the
    weights in, and transformers' own model of the family (PEFT's adapter export needs it)."""

    model_types: tuple[str, ...]  # config.json ``model_type`` values this family reads
    config_from_hf: Callable[[str | Path], Any]  # HF folder -> the family's config (ValueError by key)
    config_dict: Callable[..., dict[str, Any]]  # (cfg, *, dtype, bos/eos/pad_token_id) -> config.json
    causal_lm: Callable[[dict[str, Any]], nn.Module]  # config.json dict -> transformers' model (current device)
    to_hf_name: Callable[[str], str] = to_hf_name
    from_hf_name: Callable[[str], str] = from_hf_name
    load_weights: Callable[[nn.Module, str | Path], None] = load_hf_weights  # plain or sharded model
    check_dir: Callable[[str | Path, nn.Module], None] = check_hf_dir  # (folder, meta model): headers only
    # export: our names in order -> (HF name, our names concatenated along dim 0 into it), for a family
    # whose checkpoints fuse what it holds split (Phi-3's qkv_proj, gate_up_proj); None: one to one
    fuse: Callable[[list[str]], list[tuple[str, list[str]]]] | None = None
    # the family's chat template (assets/chat_template_<name>.jinja) for a checkpoint whose tokenizer has none
    chat_template: str | None = None

    def tensors(self, names: list[str]) -> list[tuple[str, list[str]]]:
        """The HF tensors an export writes for our parameters ``names``: (HF name, its pieces)."""
        return self.fuse(names) if self.fuse is not None else [(self.to_hf_name(n), [n]) for n in names]

    def split_modules(self, names: list[str]) -> set[str]:
        """Our modules (``q_proj``, ...) that the HF model holds fused into another: no PEFT adapter there."""
        return {p.rsplit(".", 2)[-2] for _, pieces in self.tensors(names) if len(pieces) > 1 for p in pieces}


@dataclass(frozen=True)
class ModelSpec:
    """One model family: everything the app needs of it, and nothing more."""

    name: str
    config: type  # the family's frozen config dataclass (validates itself)
    build: Callable[[Any], nn.Module]  # config -> model on the current device (meta, then ``to_empty``)
    # (model or pipeline stage, mesh, *, zero, dtype, ac, offload_params, ac_offload) -> ShardedPart:
    # the family's one recipe (TP plan -> AC -> precision -> ZeRO), taken by the engine and every stage
    parallelize: Callable[..., Any]
    # (model, mesh, engine config, *, schedule, microbatches, ..., init_fn, ...) -> PipelineEngine
    pipeline: Callable[..., Any]
    stage_init: Callable[..., Callable[[nn.Module], None]]  # (seed, *, full) -> a pipeline split's init_fn
    check_tp: Callable[[Any, int], None]  # (config, tp): ValueError unless tp splits the model evenly
    hf: HFAdapter
    # (config, working_set.RunShape) -> (device, host, backward transient) bytes of one micro-batch
    activation_memory: Callable[[Any, Any], tuple[int, int, int]]
    presets: Mapping[str, Any] = field(default_factory=dict)  # name -> config (benches, tests)
    # (config, *, pp, tp, sp, lora) -> None: ValueError, before start, for a layout the family cannot run
    check_parallel: Callable[..., None] | None = None
    # model_type -> whether this family reads it when no family lists it (the transformers path's fallback)
    claims: Callable[[str], bool] | None = None
    describe: Callable[[Any], str] | None = None  # config -> the run's line naming the path it takes


_SPECS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Add a family (its package's ``__init__`` calls this); a second spec under a taken name is an error."""
    if _SPECS.get(spec.name, spec) is not spec:
        raise ValueError(f"model family {spec.name!r} is already registered")
    _SPECS[spec.name] = spec
    return spec


def _load_builtins() -> None:
    for name in BUILTIN:
        importlib.import_module(f"deepshard.finetune.models.{name}")


def names() -> list[str]:
    """The registered families, sorted."""
    _load_builtins()
    return sorted(_SPECS)


def get(name: str) -> ModelSpec:
    """The family ``name``; ValueError naming the valid ones."""
    _load_builtins()
    if name not in _SPECS:
        raise ValueError(f"model family {name!r}: valid families are {sorted(_SPECS)}")
    return _SPECS[name]


def spec_of(cfg: Any) -> ModelSpec:
    """The family whose config class ``cfg`` is an instance of."""
    _load_builtins()
    for spec in _SPECS.values():
        if type(cfg) is spec.config:
            return spec
    raise ValueError(f"{type(cfg).__name__}: no model family has this config; families: {sorted(_SPECS)}")


def build_meta(cfg: Any) -> nn.Module:
    """``cfg``'s model on the meta device: its names and shapes, no memory (plans, checks, exports)."""
    with torch.device("meta"):
        return spec_of(cfg).build(cfg)


def for_hf(path: str | Path) -> ModelSpec:
    """The family that reads the HF folder ``path``, by its config.json's ``model_type``.  A folder
    without a readable config.json (or without model_type) goes to the default family, whose
    ``config_from_hf`` then says what is wrong with it."""
    _load_builtins()
    try:
        model_type = json.loads((Path(path) / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        model_type = None
    if model_type is None:
        return get(DEFAULT_FAMILY)
    for spec in _SPECS.values():
        if model_type in spec.hf.model_types:
            return spec
    for spec in _SPECS.values():
        if spec.claims is not None and spec.claims(model_type):
            return spec
    valid = sorted(t for spec in _SPECS.values() for t in spec.hf.model_types)
    raise ValueError(f"model.path={str(path)!r}: config.json has model_type={model_type!r}; "
                     f"supported model types are {valid}, or any with a causal LM class in transformers "
                     f"(the transformers path)")


def path_line(cfg: Any) -> str:
    """The run's line saying which path its model takes: native (the family) or its spec's own words."""
    spec = spec_of(cfg)
    return spec.describe(cfg) if spec.describe is not None else f"model: native ({spec.name})"


def from_meta(meta: Mapping[str, Any]) -> tuple[ModelSpec, Any]:
    """(family, config) of a checkpoint's manifest ``meta`` (``family``: absent before the registry,
    when the only family was the default one)."""
    spec = get(meta.get("family", DEFAULT_FAMILY))
    return spec, spec.config(**meta["model"])
