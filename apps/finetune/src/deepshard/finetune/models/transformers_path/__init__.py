"""The transformers path, registered as ``"transformers"``: ``model=hf`` on a causal LM that no native
family reads (its ``model_type`` has an ``AutoModelForCausalLM`` class) trains through transformers' own
modeling code (``model.py``) with our recipe (``parallelize.py``): ZeRO 0-3, CPU offload, AC, LoRA on
its ``nn.Linear`` layers, grad accumulation, TP where its config carries a ``base_model_tp_plan``, Ulysses
sp through transformers' attention interface (``ulysses.py``), PP for GPT-NeoX, GPT-2 (its tied head a copy on
the last stage) and OLMo2 (``pipeline.py``).  Refused before start, with the reason: pp on other architectures
or with a tied head at pp > 2, sp where the attention bypasses the interface or needs per-layer masks, LoRA on GPT-2's ``Conv1D``
(or any target the model lacks).

Its HF adapter reads config.json through transformers' own config class and writes it back
unchanged, so the export is the folder transformers loads.  The weights are hf.py's reader (each rank
reads whole tensors and keeps its shard: a row-slicing reader is the next step for load memory).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deepshard.core.memory import DTYPE_BYTES
from deepshard.finetune.models.hf import bad_value, check_hf_dir, load_hf_weights, read_json
from deepshard.finetune.models.registry import HFAdapter, ModelSpec, register
from deepshard.finetune.models.transformers_path.model import (
    TransformersConfig,
    TransformersLM,
    canonical_names,
    causal_lm_class,
)
from deepshard.finetune.models.working_set import RunShape

__all__ = ["SPEC", "TransformersConfig", "TransformersLM", "claims", "path_line"]
PREFIX = "hf."


def causal_lm_names() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def claims(model_type: str) -> bool:
    """Whether transformers has a causal LM class for ``model_type`` (asked only when no native family reads it)."""
    return model_type in causal_lm_names()


def config_from_hf(path: str | Path) -> TransformersConfig:
    """Our config of the HF folder ``path``: its config.json read by transformers' own config class (no
    code from the folder runs: no ``trust_remote_code``)."""
    from transformers import CONFIG_MAPPING

    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"model.path={str(path)!r}: no config.json there (expected a HF checkpoint directory)")
    raw = read_json(f)
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    names = causal_lm_names()
    if model_type not in names or model_type not in CONFIG_MAPPING:
        raise bad_value(path, "model_type", model_type, "transformers has no causal LM class for it")
    hf = CONFIG_MAPPING[model_type].from_dict(raw)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    archs = [a for a in (raw.get("architectures") or []) if a == names[model_type]]
    arch = archs[0] if archs else names[model_type]

    def count(key: str, default: int = 0) -> int:
        value = getattr(text, key, None)
        return int(value) if isinstance(value, int) else default

    return TransformersConfig(
        hf_config=hf.to_json_string(use_diff=False), arch=arch, vocab_size=count("vocab_size"),
        dim=count("hidden_size"), n_layers=count("num_hidden_layers"), n_heads=count("num_attention_heads"),
        ffn_hidden=count("intermediate_size") or 4 * count("hidden_size"),
        max_seq_len=count("max_position_embeddings", 2048), tie_embeddings=bool(getattr(text, "tie_word_embeddings", False)))


def config_dict(cfg: TransformersConfig, *, dtype: str = "float32", bos_token_id: int | None = None,
                eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """The config.json it was read from, with the export's dtype and the tokenizer's special ids."""
    d = cfg.hf_dict
    d["dtype"] = dtype
    d["architectures"] = [cfg.arch]
    for key, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if value is not None:
            d[key] = value
    return d


def causal_lm(config: dict[str, Any]) -> nn.Module:
    """transformers' own model of a config.json dict, on the current device."""
    from transformers import CONFIG_MAPPING

    return causal_lm_class(causal_lm_names()[config["model_type"]])(CONFIG_MAPPING[config["model_type"]].from_dict(config))


def to_hf_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").removeprefix(PREFIX)


def from_hf_name(name: str) -> str:
    return PREFIX + name


def _legacy_renames(model: nn.Module) -> list[tuple[re.Pattern[str], str]]:
    """transformers' own renames of older checkpoints' keys (GPT-NeoX's ``embed_out`` -> ``lm_head``):
    the plain renames only; a model whose keys need tensors merged is refused by name when loaded."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    hf = model.hf if isinstance(model, TransformersLM) else model
    return [(re.compile(src), dst) for t in get_model_conversion_mapping(hf) if type(t) is WeightRenaming
            for src, dst in zip(t.source_patterns, t.target_patterns, strict=False)]


def _rename(model: nn.Module) -> Callable[[str], str]:
    names = canonical_names(model)  # a tied head's name -> its embedding's; checkpointed blocks' names
    rules = _legacy_renames(model)

    def rename(hf_name: str) -> str:
        if PREFIX + hf_name not in names:
            for pattern, target in rules:
                hf_name = pattern.sub(target, hf_name)
        return names.get(PREFIX + hf_name, PREFIX + hf_name)

    return rename


def load_weights(model: nn.Module, path: str | Path) -> None:
    """hf.py's reader into our model (plain, ZeRO-3 or TP shards; checkpointed blocks' names included)."""
    load_hf_weights(model, path, rename=_rename(model))


def check_dir(path: str | Path, model: nn.Module) -> None:
    check_hf_dir(path, model, rename=_rename(model))


def check_parallel(cfg: TransformersConfig, *, pp: int = 1, tp: int = 1, sp: int = 1, lora: Any = None) -> None:
    """What this path cannot run, by key, before any worker starts."""
    from deepshard.finetune.models.transformers_path.parallelize import check_layout

    check_layout(cfg, pp=pp, sp=sp, tp=tp)
    if lora is None:
        return
    with torch.device("meta"):
        model = TransformersLM(cfg)
    found = {n.rsplit(".", 1)[-1]: type(m).__name__ for n, m in model.named_modules() if n}
    for target in lora.target_modules:
        kind = found.get(target)
        if kind is not None and kind != "Linear":
            raise ValueError(f"peft.target_modules={list(lora.target_modules)}: {target!r} is a {kind} in "
                             f"{cfg.arch}, not an nn.Linear; LoRA here wraps nn.Linear only (GPT-2's Conv1D "
                             f"stores its weight transposed and is not wrapped)")
    if not any(found.get(t) == "Linear" for t in lora.target_modules):
        linears = sorted({n for n, k in found.items() if k in ("Linear", "Conv1D")})
        raise ValueError(f"peft.target_modules={list(lora.target_modules)}: {cfg.arch} has no nn.Linear of those "
                         f"names (its projections: {linears[:8]})")


def keeps_scores(cfg: TransformersConfig) -> bool:
    """Whether the model's attention runs eager (its [heads, seq, seq] scores and probabilities kept for
    backward): transformers picks SDPA for every class that supports it (GPT-Neo, Bloom do not)."""
    return not getattr(causal_lm_class(cfg.arch), "_supports_sdpa", False)


def activation_memory(cfg: TransformersConfig, s: RunShape) -> tuple[int, int, int]:
    """A bound (device, host, backward transient) per micro-batch on one rank for a model whose code we
    do not count tensor by tensor.  Per token and block, ``15 x dim + 5 x ffn_hidden`` elements: the
    largest of what autograd saves per block in GPT-2 (its tanh GELU keeps 5 x ffn), GPT-NeoX (its fused
    qkv output beside the rotated q/k) and OLMo2 (q/k norms, post norms, a gated MLP), counted with
    saved-tensor hooks.  Attention: with SDPA its fp32 log-sum-exp per head, and per block the [seq, seq]
    additive mask of the compute dtype that SDPA keeps where transformers builds a 4-D mask (packed rows'
    restarting positions: ``data.pack`` with ``data.doc_mask``, the default; a sliding window), none for
    causal rows (SDPA's own ``is_causal``); eager attention its scores, probabilities and
    dropout mask [heads, seq, seq] instead (under sp: heads / sp over the whole row).  Plus the logits
    [tokens, vocab] in the compute dtype.  Measured against a training step's peak on GPT-NeoX by
    tests/sp/test_sp_estimate.py (the ratio is in the README)."""
    b = DTYPE_BYTES[s.dtype]
    tokens = s.micro_batch_size * s.seq_len
    seq = s.seq_len * max(s.sp, 1)  # attention's keys: the whole row under Ulysses
    saved = tokens * (b * (15 * cfg.dim + 5 * cfg.ffn_hidden) + 4 * cfg.n_heads)
    if keeps_scores(cfg):
        saved += tokens * cfg.n_heads * seq * (2 * b + 1)
    elif s.doc_mask or cfg.hf_dict.get("sliding_window"):
        saved += s.micro_batch_size * seq * seq * b
    transient = tokens * max(cfg.ffn_hidden, 4 * cfg.dim) * b * 2
    logits = tokens * cfg.vocab_size * b
    if s.ac == "none":
        return cfg.n_layers * saved + logits + transient, 0, transient
    every = int(s.ac.split("_")[1]) if s.ac.startswith("every_") else 1
    recomputed = cfg.n_layers // every
    inputs = recomputed * tokens * cfg.dim * b
    kept = (cfg.n_layers - recomputed) * saved + saved + logits + transient
    if s.ac_offload:
        return kept, inputs, saved + transient
    return kept + inputs, 0, saved + transient


def path_line(cfg: TransformersConfig) -> str:
    """The run's line saying which path it took (the registry's ``path_line``)."""
    return f"model: transformers path ({cfg.arch})"


def _parallelize(model: nn.Module, mesh: Any, **kwargs: Any) -> Any:
    from deepshard.finetune.models.transformers_path.parallelize import parallelize_transformers

    return parallelize_transformers(model, mesh, **kwargs)


def _check_tp(cfg: TransformersConfig, tp: int) -> None:
    from deepshard.finetune.models.transformers_path.parallelize import check_tp

    check_tp(cfg, tp)


def _pipeline(*args: Any, **kwargs: Any) -> Any:
    from deepshard.finetune.models.transformers_path.pipeline import pipeline_transformers

    return pipeline_transformers(*args, **kwargs)


def _stage_init(*args: Any, **kwargs: Any) -> Any:
    from deepshard.finetune.models.transformers_path.pipeline import stage_init

    return stage_init(*args, **kwargs)


ADAPTER = HFAdapter(model_types=(), config_from_hf=config_from_hf, config_dict=config_dict, causal_lm=causal_lm,
                    to_hf_name=to_hf_name, from_hf_name=from_hf_name, load_weights=load_weights, check_dir=check_dir)
SPEC = register(ModelSpec(name="transformers", config=TransformersConfig, build=TransformersLM,
                          parallelize=_parallelize, pipeline=_pipeline, stage_init=_stage_init,
                          check_tp=_check_tp, hf=ADAPTER, activation_memory=activation_memory,
                          check_parallel=check_parallel, claims=claims,
                          describe=path_line))
