"""The Qwen2-MoE family (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder (q/k/v biases) with sparse MoE
blocks that add a shared expert gated by a sigmoid (models/moe.py), registered as ``"qwen2_moe"``.
Its HF adapter reads and writes Qwen2MoeForCausalLM's config.json: ``num_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``,
``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers`` (dense MLPs of ``intermediate_size``
there), ``router_aux_loss_coef``; per-layer sliding windows are refused."""

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

HF_ARCH = "Qwen2MoeForCausalLM"


@dataclass(frozen=True)
class Qwen2MoeConfig(MoeConfig):
    qkv_bias: bool = True
    rope_theta: float = 1000000.0
    routing: str = "softmax_topk"
    norm_topk_prob: bool = False  # HF's default
    shared_expert_hidden: int = 5632  # HF's default shared_expert_intermediate_size


def config_from_hf(path: str | Path) -> Qwen2MoeConfig:
    """Our Qwen2MoeConfig from a Qwen2-MoE ``config.json``."""
    c = read_config(path, ("qwen2_moe",))
    refuse_sliding(path, c)
    if c.get("qkv_bias") is False:
        raise bad_value(path, "qkv_bias", False, "Qwen2-MoE here has q/k/v biases (true)")
    experts = c.get("num_experts")
    if not experts:
        raise bad_value(path, "num_experts", experts, "a Qwen2-MoE model needs experts (> 0)")
    shared = c.get("shared_expert_intermediate_size", 5632)
    if not shared:
        raise bad_value(path, "shared_expert_intermediate_size", shared, "Qwen2-MoE's shared expert needs a width > 0")
    return Qwen2MoeConfig(**decoder_fields(path, c), num_experts=experts,
                          num_experts_per_tok=c.get("num_experts_per_tok", 4),
                          moe_hidden=c.get("moe_intermediate_size", 1408), shared_expert_hidden=shared,
                          norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                          decoder_sparse_step=c.get("decoder_sparse_step", 1),
                          mlp_only_layers=tuple(c.get("mlp_only_layers") or ()),
                          router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)))


def config_dict(cfg: Qwen2MoeConfig, *, dtype: str = "float32", bos_token_id: int | None = None,
                eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """A ``config.json`` for Qwen2MoeForCausalLM describing ``cfg`` (built by transformers itself)."""
    from transformers import Qwen2MoeConfig as HFConfig

    refuse_switches(cfg, "qwen2_moe", qkv_bias=True)
    for key, value, want in (("qkv_bias", cfg.qkv_bias, True), ("routing", cfg.routing, "softmax_topk")):
        if value != want:
            raise ValueError(f"model.{key}={value!r}: Qwen2MoeForCausalLM has only {want!r}")
    if cfg.shared_expert_hidden < 1:
        raise ValueError(f"model.shared_expert_hidden={cfg.shared_expert_hidden}: Qwen2MoeForCausalLM always has a "
                         f"shared expert (> 0)")
    fields = hf_fields(cfg, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, arch=HF_ARCH)
    return HFConfig(**fields, qkv_bias=True, use_sliding_window=False, num_experts=cfg.num_experts,
                    num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_hidden,
                    shared_expert_intermediate_size=cfg.shared_expert_hidden, norm_topk_prob=cfg.norm_topk_prob,
                    decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
                    router_aux_loss_coef=cfg.router_aux_loss_coef).to_dict()


def causal_lm(config: dict[str, Any]) -> nn.Module:
    """transformers' Qwen2MoeForCausalLM of a config.json dict."""
    from transformers import Qwen2MoeConfig as HFConfig
    from transformers import Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(HFConfig.from_dict(config))


SPEC = moe_spec("qwen2_moe", Qwen2MoeConfig, HFAdapter(model_types=("qwen2_moe",), config_from_hf=config_from_hf,
                                                       config_dict=config_dict, causal_lm=causal_lm,
                                                       chat_template="chatml"))
