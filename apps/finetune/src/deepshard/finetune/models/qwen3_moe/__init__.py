"""The Qwen3-MoE family: the Qwen3 decoder (q/k RMSNorm, its own ``head_dim``) with sparse MoE blocks
(softmax over every expert, top k, renormalized when ``norm_topk_prob``), registered as ``"qwen3_moe"``.
Its HF adapter reads and writes Qwen3MoeForCausalLM's config.json: ``num_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``,
``mlp_only_layers`` (dense MLPs of ``intermediate_size`` there), ``router_aux_loss_coef``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from deepshard.finetune.models.hf import bad_value
from deepshard.finetune.models.llama.hf import (
    decoder_fields,
    hf_fields,
    read_config,
    refuse_sliding,
    refuse_switches,
)
from deepshard.finetune.models.moe_decoder import MoeConfig, moe_spec
from deepshard.finetune.models.registry import HFAdapter

HF_ARCH = "Qwen3MoeForCausalLM"


@dataclass(frozen=True)
class Qwen3MoeConfig(MoeConfig):
    qk_norm: bool = True
    rope_theta: float = 1000000.0
    routing: str = "softmax_topk"
    norm_topk_prob: bool = False  # HF's default


def config_from_hf(path: str | Path) -> Qwen3MoeConfig:
    """Our Qwen3MoeConfig from a Qwen3-MoE ``config.json``."""
    c = read_config(path, ("qwen3_moe",))
    refuse_sliding(path, c)
    if c.get("attention_bias"):
        raise bad_value(path, "attention_bias", c["attention_bias"], "Qwen3-MoE's attention has no biases here")
    experts = c.get("num_experts") or c.get("num_local_experts")  # transformers 5 writes the latter
    if not experts:
        raise bad_value(path, "num_experts", experts, "a Qwen3-MoE model needs experts (> 0)")
    return Qwen3MoeConfig(**{**decoder_fields(path, c), "head_dim": c.get("head_dim", 128)},
                          num_experts=experts, num_experts_per_tok=c.get("num_experts_per_tok", 8),
                          moe_hidden=c.get("moe_intermediate_size", 768),
                          norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                          decoder_sparse_step=c.get("decoder_sparse_step", 1),
                          mlp_only_layers=tuple(c.get("mlp_only_layers") or ()),
                          router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)))


def config_dict(cfg: Qwen3MoeConfig, *, dtype: str = "float32", bos_token_id: int | None = None,
                eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """A ``config.json`` for Qwen3MoeForCausalLM describing ``cfg`` (built by transformers itself)."""
    from transformers import Qwen3MoeConfig as HFConfig

    refuse_switches(cfg, "qwen3_moe", qk_norm=True)
    if not cfg.qk_norm or cfg.routing != "softmax_topk":
        raise ValueError("model.qk_norm/model.routing: Qwen3MoeForCausalLM always normalizes q and k and routes "
                         "softmax_topk")
    fields = hf_fields(cfg, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, arch=HF_ARCH)
    return HFConfig(**fields, attention_bias=False, use_sliding_window=False, num_experts=cfg.num_experts,
                    num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_hidden,
                    norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
                    mlp_only_layers=list(cfg.mlp_only_layers),
                    router_aux_loss_coef=cfg.router_aux_loss_coef).to_dict()


def causal_lm(config: dict[str, Any]) -> nn.Module:
    """transformers' Qwen3MoeForCausalLM of a config.json dict."""
    from transformers import Qwen3MoeConfig as HFConfig
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(HFConfig.from_dict(config))


SPEC = moe_spec("qwen3_moe", Qwen3MoeConfig, HFAdapter(model_types=("qwen3_moe",), config_from_hf=config_from_hf,
                                                       config_dict=config_dict, causal_lm=causal_lm,
                                                       chat_template="chatml"))
