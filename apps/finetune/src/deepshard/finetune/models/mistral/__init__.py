"""The Mistral family: the Llama decoder whose attention slides (a position sees itself and the
``sliding_window - 1`` positions before it; HF's ``sliding_window``), registered as ``"mistral"``.
Its HF adapter reads and writes MistralForCausalLM's config.json (``sliding_window: null`` is full
attention)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from deepshard.finetune.models.hf import bad_value
from deepshard.finetune.models.llama import LlamaConfig, decoder_spec
from deepshard.finetune.models.llama.hf import decoder_fields, hf_fields, read_config, refuse_switches
from deepshard.finetune.models.registry import HFAdapter

HF_ARCH = "MistralForCausalLM"


@dataclass(frozen=True)
class MistralConfig(LlamaConfig):
    sliding_window: int = 4096


def config_from_hf(path: str | Path) -> MistralConfig:
    """Our MistralConfig from a Mistral ``config.json``."""
    c = read_config(path, ("mistral",))
    if "layer_types" in c:  # transformers sends these to its Ministral classes
        raise bad_value(path, "layer_types", c["layer_types"], "alternating attention layers are not supported")
    if c.get("attention_bias"):
        raise bad_value(path, "attention_bias", c["attention_bias"], "Mistral's attention has no biases here")
    return MistralConfig(**decoder_fields(path, c), sliding_window=c.get("sliding_window") or 0)


def config_dict(cfg: MistralConfig, *, dtype: str = "float32", bos_token_id: int | None = None,
                eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """A ``config.json`` for MistralForCausalLM describing ``cfg`` (built by transformers itself)."""
    from transformers import MistralConfig as HFMistralConfig

    refuse_switches(cfg, "mistral", sliding_window=True)
    fields = hf_fields(cfg, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, arch=HF_ARCH)
    return HFMistralConfig(**fields, sliding_window=cfg.sliding_window or None).to_dict()


def causal_lm(config: dict[str, Any]) -> nn.Module:
    """transformers' MistralForCausalLM of a config.json dict (PEFT's export)."""
    from transformers import MistralConfig as HFMistralConfig
    from transformers import MistralForCausalLM

    return MistralForCausalLM(HFMistralConfig.from_dict(config))


SPEC = decoder_spec("mistral", MistralConfig, HFAdapter(model_types=("mistral",), config_from_hf=config_from_hf,
                                                        config_dict=config_dict, causal_lm=causal_lm,
                                                        chat_template="mistral"))
