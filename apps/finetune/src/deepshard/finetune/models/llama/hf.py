"""The Llama family's HF adapter: LlamaForCausalLM's config.json both ways (Mistral's and Qwen2's
too, where they have nothing our Llama lacks), and transformers' own model for PEFT's export.

Our RoPE is HF's rotate-half convention, so weights move across unchanged (names: ``models/hf.py``).
Only what our model can represent is accepted; anything else (biases, RoPE scaling, another
head_dim) is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from deepshard.finetune.models.hf import bad_value, read_json
from deepshard.finetune.models.llama.model import LlamaConfig
from deepshard.finetune.models.registry import HFAdapter

HF_ARCH = "LlamaForCausalLM"
MODEL_TYPES = ("llama", "mistral", "qwen2")
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def llama_config_from_hf(path: str | Path) -> LlamaConfig:
    """Our LlamaConfig from a HF ``config.json`` (read as JSON: no transformers import needed)."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"model.path={str(path)!r}: no config.json there (expected a HF checkpoint directory)")
    c = read_json(f)
    if not isinstance(c, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(c).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in c]
    if missing:
        raise ValueError(f"{f}: missing key {missing[0]!r} (a Llama config.json needs {list(REQUIRED_KEYS)})")
    if c.get("model_type") not in (*MODEL_TYPES, None):
        raise bad_value(path, "model_type", c.get("model_type"), "only the Llama family is supported")
    if c.get("hidden_act", "silu") != "silu":
        raise bad_value(path, "hidden_act", c["hidden_act"], "only silu (SwiGLU) is supported")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise bad_value(path, key, c[key], "our Llama has no biases")
    rope = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise bad_value(path, "rope_type", rope_type, "only default RoPE is supported")
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    if head_dim * heads != c["hidden_size"]:
        raise bad_value(path, "head_dim", head_dim, "must be hidden_size / num_attention_heads")
    return LlamaConfig(
        vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads, ffn_hidden=c["intermediate_size"],
        max_seq_len=c.get("max_position_embeddings", 2048), rope_theta=float(rope.get("rope_theta",
                                                                                   c.get("rope_theta", 10000.0))),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
    )


def hf_config_dict(cfg: LlamaConfig, *, dtype: str = "float32", bos_token_id: int | None = None,
                   eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """A ``config.json`` for LlamaForCausalLM describing ``cfg`` (built by transformers itself)."""
    from transformers import LlamaConfig as HFLlamaConfig

    hf = HFLlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, head_dim=cfg.head_dim, architectures=[HF_ARCH], dtype=dtype,
    )
    return hf.to_dict()


def causal_lm(config: dict[str, Any]) -> nn.Module:
    """transformers' LlamaForCausalLM of a config.json dict, on the current device (meta for PEFT's export)."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(HFLlamaConfig.from_dict(config))


ADAPTER = HFAdapter(model_types=MODEL_TYPES, config_from_hf=llama_config_from_hf, config_dict=hf_config_dict,
                    causal_lm=causal_lm)
