"""The Gemma families, registered as ``"gemma2"`` (HF model_type gemma2) and ``"gemma3"`` (gemma3_text,
and gemma3: a vision-language checkpoint whose text part is read): one decoder (``model.py``), two
configs whose defaults are each version's (Gemma 2: soft-capping on, sliding every other layer, one
RoPE base; Gemma 3: soft-capping off, q/k norms, five sliding layers to a global one, a RoPE base per
kind of layer).  PP runs at pp=2, the tied head a copy on the last stage (``parallelize.pipeline_gemma``)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from deepshard.finetune.models.gemma.hf import (
    causal_lm_of,
    gemma3_from_hf_name,
    gemma_fields,
    hf_fields,
    read_text_config,
)
from deepshard.finetune.models.gemma.memory import activation_memory
from deepshard.finetune.models.gemma.model import FULL, SLIDING, Gemma, GemmaConfig
from deepshard.finetune.models.gemma.parallelize import check_parallel, check_tp
from deepshard.finetune.models.hf import check_hf_dir, load_hf_weights
from deepshard.finetune.models.registry import HFAdapter, ModelSpec, register

__all__ = ["Gemma", "Gemma2Config", "Gemma3Config", "GemmaConfig"]


@dataclass(frozen=True)
class Gemma2Config(GemmaConfig):
    attn_softcap: float = 50.0
    final_softcap: float = 30.0
    sliding_pattern: int = 2


@dataclass(frozen=True)
class Gemma3Config(GemmaConfig):
    qk_norm: bool = True
    rope_theta: float = 1_000_000.0
    sliding_pattern: int = 6


def _gemma2_from_hf(path: str | Path) -> Gemma2Config:
    """Our Gemma2Config from a Gemma 2 ``config.json``."""
    return Gemma2Config(**gemma_fields(path, read_text_config(path, ("gemma2",)), gemma3=False))


def _gemma3_from_hf(path: str | Path) -> Gemma3Config:
    """Our Gemma3Config from a Gemma 3 text ``config.json`` or a vision-language one's text part."""
    return Gemma3Config(**gemma_fields(path, read_text_config(path, ("gemma3_text", "gemma3")), gemma3=True))


def _gemma2_dict(cfg: GemmaConfig, **ids: Any) -> dict[str, Any]:
    """A ``config.json`` for Gemma2ForCausalLM describing ``cfg`` (built by transformers itself)."""
    from transformers import Gemma2Config as HFGemma2Config

    if cfg.qk_norm or cfg.rope_local_theta != cfg.rope_theta or cfg.rope_factor != 1.0:
        raise ValueError("model.qk_norm / rope_local_theta / rope_factor: Gemma2ForCausalLM has one RoPE and no q/k "
                         "norm; export this model as gemma3")
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return HFGemma2Config(**hf_fields(cfg, arch="Gemma2ForCausalLM", **_ids(ids)), rope_parameters=rope).to_dict()


def _gemma3_dict(cfg: GemmaConfig, **ids: Any) -> dict[str, Any]:
    """A ``config.json`` for Gemma3ForCausalLM describing ``cfg`` (built by transformers itself)."""
    from transformers import Gemma3TextConfig

    if not cfg.qk_norm or cfg.attn_softcap:
        raise ValueError(f"model.qk_norm={cfg.qk_norm}, model.attn_softcap={cfg.attn_softcap}: Gemma3ForCausalLM "
                         "always normalizes q and k and never soft-caps attention scores")
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_factor != 1.0:
        full = {**full, "rope_type": "linear", "factor": cfg.rope_factor}
    rope = {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": cfg.rope_local_theta}}
    return Gemma3TextConfig(**hf_fields(cfg, arch="Gemma3ForCausalLM", **_ids(ids)), rope_parameters=rope).to_dict()


def _ids(ids: dict[str, Any]) -> dict[str, Any]:
    return {"dtype": ids.get("dtype", "float32"), **{k: ids.get(k) for k in ("bos_token_id", "eos_token_id",
                                                                             "pad_token_id")}}


def _pipeline(model: Any, mesh: Any, config: Any, **kwargs: Any) -> Any:
    from deepshard.finetune.models.gemma.parallelize import pipeline_gemma

    return pipeline_gemma(model, mesh, config, **kwargs)


def _stage_init(seed: int = 0, **kwargs: Any) -> Any:
    from deepshard.finetune.models.gemma.parallelize import gemma_stage_init

    return gemma_stage_init(seed, **kwargs)


def _parallelize(model: Any, mesh: Any, **kwargs: Any) -> Any:
    from deepshard.finetune.models.gemma.parallelize import parallelize_gemma

    return parallelize_gemma(model, mesh, **kwargs)


def _spec(name: str, config: type, hf: HFAdapter) -> ModelSpec:
    return register(ModelSpec(name=name, config=config, build=Gemma, parallelize=_parallelize,
                              pipeline=_pipeline, stage_init=_stage_init, check_tp=check_tp, hf=hf,
                              activation_memory=activation_memory, check_parallel=check_parallel))


GEMMA2 = _spec("gemma2", Gemma2Config, HFAdapter(
    model_types=("gemma2",), config_from_hf=_gemma2_from_hf, config_dict=_gemma2_dict,
    causal_lm=partial(causal_lm_of, "Gemma2ForCausalLM", "Gemma2Config"), chat_template="gemma"))
GEMMA3 = _spec("gemma3", Gemma3Config, HFAdapter(
    model_types=("gemma3_text", "gemma3"), config_from_hf=_gemma3_from_hf, config_dict=_gemma3_dict,
    causal_lm=partial(causal_lm_of, "Gemma3ForCausalLM", "Gemma3TextConfig"),
    from_hf_name=gemma3_from_hf_name, load_weights=partial(load_hf_weights, rename=gemma3_from_hf_name),
    check_dir=partial(check_hf_dir, rename=gemma3_from_hf_name), chat_template="gemma"))
