"""The Qwen2 / Qwen2.5 family: the Llama decoder with biases on q/k/v (o has none), registered as
``"qwen2"``.  Its HF adapter reads and writes Qwen2ForCausalLM's config.json; Qwen's per-layer
sliding windows (``use_sliding_window``, off in every released Qwen2.5) are refused."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from deepshard.finetune.models.llama import LlamaConfig, decoder_spec
from deepshard.finetune.models.llama.hf import (
    decoder_fields,
    hf_fields,
    read_config,
    refuse_sliding,
    refuse_switches,
)
from deepshard.finetune.models.registry import HFAdapter

HF_ARCH = "Qwen2ForCausalLM"


@dataclass(frozen=True)
class Qwen2Config(LlamaConfig):
    qkv_bias: bool = True
    rope_theta: float = 1000000.0


def config_from_hf(path: str | Path) -> Qwen2Config:
    """Our Qwen2Config from a Qwen2 ``config.json`` (its q/k/v biases are part of the architecture)."""
    c = read_config(path, ("qwen2",))
    refuse_sliding(path, c)
    return Qwen2Config(**decoder_fields(path, c))


def config_dict(cfg: Qwen2Config, *, dtype: str = "float32", bos_token_id: int | None = None,
                eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """A ``config.json`` for Qwen2ForCausalLM describing ``cfg`` (built by transformers itself)."""
    from transformers import Qwen2Config as HFQwen2Config

    refuse_switches(cfg, "qwen2", qkv_bias=True)
    if not cfg.qkv_bias:
        raise ValueError("model.qkv_bias=False: Qwen2ForCausalLM always has q/k/v biases")
    fields = hf_fields(cfg, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, arch=HF_ARCH)
    return HFQwen2Config(**fields, use_sliding_window=False).to_dict()


def causal_lm(config: dict[str, Any]) -> nn.Module:
    """transformers' Qwen2ForCausalLM of a config.json dict (PEFT's export)."""
    from transformers import Qwen2Config as HFQwen2Config
    from transformers import Qwen2ForCausalLM

    return Qwen2ForCausalLM(HFQwen2Config.from_dict(config))


SPEC = decoder_spec("qwen2", Qwen2Config, HFAdapter(model_types=("qwen2",), config_from_hf=config_from_hf,
                                                    config_dict=config_dict, causal_lm=causal_lm,
                                                    chat_template="chatml"))
