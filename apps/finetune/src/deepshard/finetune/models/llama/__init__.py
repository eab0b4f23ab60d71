"""The Llama family (Mistral and Qwen2 checkpoints too, where they have nothing our Llama lacks):
its model, TP plan and recipe, pipeline split, HF adapter and activation memory, registered as
``"llama"``.  The recipe's and the pipeline's modules are imported when first called, so reading a
config (the launcher) does not pay for ``torch.distributed.pipelining``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from deepshard.finetune.models.llama.hf import ADAPTER
from deepshard.finetune.models.llama.memory import activation_memory
from deepshard.finetune.models.llama.model import PRESETS, Llama, LlamaConfig
from deepshard.finetune.models.registry import ModelSpec, register

__all__ = ["PRESETS", "SPEC", "Llama", "LlamaConfig"]


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


SPEC = register(ModelSpec(name="llama", config=LlamaConfig, build=Llama, parallelize=_parallelize,
                          pipeline=_pipeline, stage_init=_stage_init, check_tp=_check_tp, hf=ADAPTER,
                          activation_memory=activation_memory, presets=PRESETS))
