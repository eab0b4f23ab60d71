"""The Mixtral family: the Llama decoder with a sparse MoE block in every layer (the top k router
logits, softmax over those k), registered as ``"mixtral"``.  Its HF adapter reads and writes
MixtralForCausalLM's config.json: ``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size``
(each expert's width), ``router_aux_loss_coef``; ``sliding_window`` must be null (full attention) and
``router_jitter_noise`` 0."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from deepshard.finetune.models.hf import bad_value
from deepshard.finetune.models.llama.hf import decoder_fields, hf_fields, read_config, refuse_switches
from deepshard.finetune.models.moe_decoder import MoeConfig, moe_spec
from deepshard.finetune.models.registry import HFAdapter

HF_ARCH = "MixtralForCausalLM"


@dataclass(frozen=True)
class MixtralConfig(MoeConfig):
    rope_theta: float = 1000000.0
    routing: str = "topk_softmax"


def config_from_hf(path: str | Path) -> MixtralConfig:
    """Our MixtralConfig from a Mixtral ``config.json``."""
    c = read_config(path, ("mixtral",))
    if c.get("sliding_window"):
        raise bad_value(path, "sliding_window", c["sliding_window"], "only null (full attention) is supported for "
                        "Mixtral here")
    if c.get("router_jitter_noise"):
        raise bad_value(path, "router_jitter_noise", c["router_jitter_noise"], "only 0 is supported")
    if c.get("attention_bias"):
        raise bad_value(path, "attention_bias", c["attention_bias"], "Mixtral's attention has no biases here")
    fields = decoder_fields(path, c)
    return MixtralConfig(**fields, num_experts=c.get("num_local_experts", 8),
                         num_experts_per_tok=c.get("num_experts_per_tok", 2), moe_hidden=fields["ffn_hidden"],
                         router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)))


def config_dict(cfg: MixtralConfig, *, dtype: str = "float32", bos_token_id: int | None = None,
                eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """A ``config.json`` for MixtralForCausalLM describing ``cfg`` (built by transformers itself)."""
    from transformers import MixtralConfig as HFConfig

    refuse_switches(cfg, "mixtral")
    for key, value, want in (("routing", cfg.routing, "topk_softmax"), ("decoder_sparse_step", cfg.decoder_sparse_step, 1),
                             ("mlp_only_layers", cfg.mlp_only_layers, ())):
        if value != want:
            raise ValueError(f"model.{key}={value!r}: MixtralForCausalLM has only {want!r}")
    fields = hf_fields(cfg, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, arch=HF_ARCH)
    fields["intermediate_size"] = cfg.moe_hidden
    return HFConfig(**fields, sliding_window=None, num_local_experts=cfg.num_experts,
                    num_experts_per_tok=cfg.num_experts_per_tok,
                    router_aux_loss_coef=cfg.router_aux_loss_coef).to_dict()


def causal_lm(config: dict[str, Any]) -> nn.Module:
    """transformers' MixtralForCausalLM of a config.json dict."""
    from transformers import MixtralConfig as HFConfig
    from transformers import MixtralForCausalLM

    return MixtralForCausalLM(HFConfig.from_dict(config))


SPEC = moe_spec("mixtral", MixtralConfig, HFAdapter(model_types=("mixtral",), config_from_hf=config_from_hf,
                                                    config_dict=config_dict, causal_lm=causal_lm,
                                                    chat_template="mistral"))
