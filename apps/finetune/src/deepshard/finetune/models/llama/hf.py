"""The Llama family's HF adapter: LlamaForCausalLM's config.json both ways (Llama 3.1's ``llama3``
RoPE scaling and Llama 3.2's tied embeddings included), and transformers' own model for PEFT's export.

The decoder's common keys are read here once (``read_config``, ``decoder_fields``) for every family
that is this decoder with a switch (``models/qwen2``, ``qwen3``, ``mistral``); each adds its own.
Our RoPE is HF's rotate-half convention, so weights move across unchanged (names: ``models/hf.py``).
Only what our model can represent is accepted; anything else is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from deepshard.finetune.models.hf import bad_value, read_json
from deepshard.finetune.models.llama.model import LlamaConfig
from deepshard.finetune.models.registry import HFAdapter

HF_ARCH = "LlamaForCausalLM"
MODEL_TYPES = ("llama",)
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_config(path: str | Path, model_types: tuple[str, ...]) -> dict[str, Any]:
    """A HF ``config.json`` as a dict (read as JSON: no transformers import needed), its decoder's
    required keys present and its model_type one of ``model_types``."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"model.path={str(path)!r}: no config.json there (expected a HF checkpoint directory)")
    c = read_json(f)
    if not isinstance(c, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(c).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in c]
    if missing:
        raise ValueError(f"{f}: missing key {missing[0]!r} (a decoder's config.json needs {list(REQUIRED_KEYS)})")
    if c.get("model_type") not in (*model_types, None):
        raise bad_value(path, "model_type", c.get("model_type"), f"this family reads {list(model_types)}")
    if c.get("hidden_act", "silu") != "silu":
        raise bad_value(path, "hidden_act", c["hidden_act"], "only silu (SwiGLU) is supported")
    if c.get("mlp_bias"):
        raise bad_value(path, "mlp_bias", c["mlp_bias"], "the MLP has no biases here")
    return c


def rope_of(c: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(rope_type, parameters) from transformers 5's ``rope_parameters`` or the older ``rope_scaling``."""
    params = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
    return params.get("rope_type", params.get("type", "default")), params


def refuse_sliding(path: str | Path, c: dict[str, Any]) -> None:
    """Qwen's per-layer sliding windows (``use_sliding_window``, ``layer_types``) are not built here."""
    if c.get("use_sliding_window"):
        raise bad_value(path, "use_sliding_window", True, "per-layer sliding windows are not supported")
    kinds = set(c.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise bad_value(path, "layer_types", sorted(kinds), "only full_attention layers are supported")


def decoder_fields(path: str | Path, c: dict[str, Any], *, scaling: bool = False) -> dict[str, Any]:
    """The keys every family of this decoder shares, as LlamaConfig fields; RoPE must be default
    (or ``llama3`` where ``scaling``)."""
    rope_type, rope = rope_of(c)
    if rope_type not in (("default", "llama3") if scaling else ("default",)):
        raise bad_value(path, "rope_type", rope_type, "supported: default" + (", llama3" if scaling else ""))
    heads = c["num_attention_heads"]
    fields: dict[str, Any] = dict(
        vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=heads,
        n_kv_heads=c.get("num_key_value_heads") or heads, ffn_hidden=c["intermediate_size"],
        max_seq_len=c.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        head_dim=c.get("head_dim") or 0)
    if rope_type == "llama3":
        missing = [k for k in LLAMA3_KEYS if k not in rope]
        if missing:
            raise bad_value(path, "rope_parameters", rope, f"rope_type=llama3 needs {list(LLAMA3_KEYS)}")
        fields["rope_scaling"] = tuple(float(rope[k]) for k in LLAMA3_KEYS)
    return fields


def llama_config_from_hf(path: str | Path) -> LlamaConfig:
    """Our LlamaConfig from a Llama ``config.json``."""
    c = read_config(path, MODEL_TYPES)
    if c.get("attention_bias"):
        raise bad_value(path, "attention_bias", c["attention_bias"], "our Llama has no biases")
    return LlamaConfig(**decoder_fields(path, c, scaling=True))


def hf_fields(cfg: LlamaConfig, *, dtype: str, bos_token_id: int | None, eos_token_id: int | None,
              pad_token_id: int | None, arch: str) -> dict[str, Any]:
    """The keyword arguments every family's transformers config class takes for ``cfg``."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        rope = {**rope, "rope_type": "llama3", **dict(zip(LLAMA3_KEYS, cfg.rope_scaling, strict=True))}
        rope["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_hidden,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps, rope_parameters=rope,
                tie_word_embeddings=cfg.tie_embeddings, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                pad_token_id=pad_token_id, head_dim=cfg.head_dim, architectures=[arch], dtype=dtype)


def refuse_switches(cfg: LlamaConfig, family: str, **allowed: Any) -> None:
    """Export: a switch this family's HF class cannot express is refused, naming it."""
    for key, off in (("qkv_bias", False), ("qk_norm", False), ("sliding_window", 0), ("rope_scaling", ())):
        value = getattr(cfg, key)
        if key not in allowed and value != off:
            raise ValueError(f"model.{key}={value!r}: the {family} family's HF export cannot express it")


def hf_config_dict(cfg: LlamaConfig, *, dtype: str = "float32", bos_token_id: int | None = None,
                   eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """A ``config.json`` for LlamaForCausalLM describing ``cfg`` (built by transformers itself)."""
    from transformers import LlamaConfig as HFLlamaConfig

    refuse_switches(cfg, "llama", rope_scaling=True)
    return HFLlamaConfig(**hf_fields(cfg, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                                     pad_token_id=pad_token_id, arch=HF_ARCH)).to_dict()


def causal_lm(config: dict[str, Any]) -> nn.Module:
    """transformers' LlamaForCausalLM of a config.json dict, on the current device (meta for PEFT's export)."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(HFLlamaConfig.from_dict(config))


ADAPTER = HFAdapter(model_types=MODEL_TYPES, config_from_hf=llama_config_from_hf, config_dict=hf_config_dict,
                    causal_lm=causal_lm, chat_template="llama3")
