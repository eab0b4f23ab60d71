"""The Qwen3 family: the Llama decoder with an RMSNorm over each q and k head before RoPE, no
biases, and its own ``head_dim``; registered as ``"qwen3"``.  Its HF adapter reads and writes
Qwen3ForCausalLM's config.json (``attention_bias`` and per-layer sliding windows are refused)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from deepshard.finetune.models.hf import bad_value
from deepshard.finetune.models.llama import LlamaConfig, decoder_spec
from deepshard.finetune.models.llama.hf import (
    decoder_fields,
    hf_fields,
    read_config,
    refuse_sliding,
    refuse_switches,
)
from deepshard.finetune.models.registry import HFAdapter

HF_ARCH = "Qwen3ForCausalLM"


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    qk_norm: bool = True
    rope_theta: float = 1000000.0


def config_from_hf(path: str | Path) -> Qwen3Config:
    """Our Qwen3Config from a Qwen3 ``config.json``."""
    c = read_config(path, ("qwen3",))
    refuse_sliding(path, c)
    if c.get("attention_bias"):
        raise bad_value(path, "attention_bias", c["attention_bias"], "Qwen3's attention has no biases here")
    return Qwen3Config(**{**decoder_fields(path, c), "head_dim": c.get("head_dim", 128)})  # HF's default


def config_dict(cfg: Qwen3Config, *, dtype: str = "float32", bos_token_id: int | None = None,
                eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """A ``config.json`` for Qwen3ForCausalLM describing ``cfg`` (built by transformers itself)."""
    from transformers import Qwen3Config as HFQwen3Config

    refuse_switches(cfg, "qwen3", qk_norm=True)
    if not cfg.qk_norm:
        raise ValueError("model.qk_norm=False: Qwen3ForCausalLM always normalizes q and k")
    fields = hf_fields(cfg, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, arch=HF_ARCH)
    return HFQwen3Config(**fields, attention_bias=False, use_sliding_window=False).to_dict()


def causal_lm(config: dict[str, Any]) -> nn.Module:
    """transformers' Qwen3ForCausalLM of a config.json dict (PEFT's export)."""
    from transformers import Qwen3Config as HFQwen3Config
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM(HFQwen3Config.from_dict(config))


SPEC = decoder_spec("qwen3", Qwen3Config, HFAdapter(model_types=("qwen3",), config_from_hf=config_from_hf,
                                                    config_dict=config_dict, causal_lm=causal_lm,
                                                    chat_template="chatml"))
