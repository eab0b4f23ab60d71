"""The Llama family: its model, TP plan and recipe, pipeline split, HF adapter and activation
memory, registered as ``"llama"``; ``decoder_spec`` registers a family that is this decoder with a
switch (Qwen2, Qwen3, Mistral: their config class and HF adapter, everything else Llama's).  The recipe's and the pipeline's modules are imported when first called, so reading a
config (the launcher) does not pay for ``torch.distributed.pipelining``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from deepshard.finetune.models.llama.hf import ADAPTER
from deepshard.finetune.models.llama.memory import activation_memory
from deepshard.finetune.models.llama.model import PRESETS, Llama, LlamaConfig
from deepshard.finetune.models.registry import HFAdapter, ModelSpec, register

__all__ = ["PRESETS", "SPEC", "Llama", "LlamaConfig", "check_parallel", "decoder_spec"]


def _parallelize(model: nn.Module, mesh: Any, **kwargs: Any) -> Any:
    from deepshard.finetune.models.llama.parallelize import parallelize_llama

    return parallelize_llama(model, mesh, **kwargs)


def _pipeline(model: nn.Module, mesh: Any, config: Any, **kwargs: Any) -> Any:
    from deepshard.finetune.models.llama.parallelize import pipeline_llama

    return pipeline_llama(model, mesh, config, **kwargs)


def _check_tp(cfg: LlamaConfig, tp: int) -> None:
    from deepshard.finetune.models.llama.parallelize import check_tp

    check_tp(cfg, tp)


def _stage_init(seed: int = 0, **kwargs: Any) -> Callable[[nn.Module], None]:
    from deepshard.finetune.models.llama.parallelize import llama_stage_init

    return llama_stage_init(seed, **kwargs)


def check_parallel(cfg: LlamaConfig, *, pp: int = 1, tp: int = 1, sp: int = 1, lora: Any = None, ep: int = 1) -> None:
    """Before start: a tied head (Llama 3.2, SmolLM2, Qwen2.5/Qwen3's small models) runs at pp=2 (the last
    stage's copy of the embedding, its gradient summed with the first stage's: ``deepshard.pipeline.tied``)
    and is refused at larger pp.  (``ep``: the settings' own check says that a dense model has no experts.)"""
    if cfg.tie_embeddings:
        from deepshard.pipeline.tied import check_tied_pp

        check_tied_pp(pp, what="the model ties its head to its embedding (model.tie_embeddings=True, config.json "
                               "tie_word_embeddings)")


def decoder_spec(name: str, config: type, hf: HFAdapter, presets: Mapping[str, Any] | None = None) -> ModelSpec:
    """Register the family ``name``: this decoder built from ``config`` (a LlamaConfig subclass whose
    defaults set its switches), read and written by ``hf``."""
    return register(ModelSpec(name=name, config=config, build=Llama, parallelize=_parallelize,
                              pipeline=_pipeline, stage_init=_stage_init, check_tp=_check_tp, hf=hf,
                              activation_memory=activation_memory, presets=presets or {},
                              check_parallel=check_parallel))


SPEC = decoder_spec("llama", LlamaConfig, ADAPTER, PRESETS)
