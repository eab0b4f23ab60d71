"""Gemma 2 / Gemma 3's HF adapters: their config.json both ways, and the names of Gemma 3's
vision-language checkpoints (Gemma3ForConditionalGeneration: the text weights under
``model.language_model.`` (transformers 5) or ``language_model.model.`` (4.x)), whose text part is
read and trained; the vision tower and its projector are left out, said in one line when the config
is read, and the export is the text model (Gemma3ForCausalLM).

Read as JSON (no transformers import); only what ``GemmaConfig`` can represent is accepted, the rest
refused by key.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from torch import nn

from deepshard.finetune.models.gemma.model import FULL, SLIDING, GemmaConfig
from deepshard.finetune.models.hf import bad_value, read_json

REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")
TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
# Gemma3TextConfig's defaults for what a vision-language config.json's text_config may leave out
TEXT_DEFAULTS = dict(vocab_size=262_208, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                     max_position_embeddings=131_072, sliding_window=4096)


def read_text_config(path: str | Path, model_types: tuple[str, ...]) -> dict[str, Any]:
    """config.json's text model as a dict (a vision-language config's ``text_config``, said in one
    line that its vision tower is left out), its required keys there and its switches ours."""
    f = Path(path) / "config.json"
    if not f.is_file():
        raise ValueError(f"model.path={str(path)!r}: no config.json there (expected a HF checkpoint directory)")
    c = read_json(f)
    if not isinstance(c, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(c).__name__}")
    if c.get("model_type") not in (*model_types, None):
        raise bad_value(path, "model_type", c.get("model_type"), f"this family reads {list(model_types)}")
    if isinstance(c.get("text_config"), dict):
        warnings.warn(f"model.path={str(path)!r}: a vision-language Gemma 3 ({c.get('architectures')}): its text "
                      "model is trained; the vision tower and multi_modal_projector are not loaded, trained or "
                      "exported (the export is Gemma3ForCausalLM)", stacklevel=2)
        c = {**TEXT_DEFAULTS, **c["text_config"], "tie_word_embeddings": c.get("tie_word_embeddings", True)}
    missing = [k for k in REQUIRED_KEYS if k not in c]
    if missing:
        raise ValueError(f"{f}: missing key {missing[0]!r} (Gemma's config.json needs {list(REQUIRED_KEYS)})")
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise bad_value(path, "hidden_activation", act, "only gelu_pytorch_tanh (GeGLU) is supported")
    for key, off in (("attention_bias", False), ("use_bidirectional_attention", False),
                     ("tie_word_embeddings", True)):
        if bool(c.get(key, off)) != off:
            raise bad_value(path, key, c[key], f"supported: {off}")
    return c


def _rope(path: str | Path, params: dict[str, Any], key: str, linear: bool) -> tuple[float, float]:
    """(theta, linear factor) of one ``rope_parameters`` entry: default RoPE (or linear where allowed)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in (("default", "linear") if linear else ("default",)):
        raise bad_value(path, key, params, "supported rope_type: default" + (", linear" if linear else ""))
    return float(params["rope_theta"]), float(params.get("factor", 1.0)) if kind == "linear" else 1.0


def gemma_fields(path: str | Path, c: dict[str, Any], *, gemma3: bool) -> dict[str, Any]:
    """GemmaConfig's fields from a text config dict (Gemma 2's one RoPE, Gemma 3's per layer type)."""
    heads = c["num_attention_heads"]
    rope = c.get("rope_parameters") or {}
    if gemma3 and c.get("attn_logit_softcapping"):  # transformers' Gemma3Attention passes no cap
        raise bad_value(path, "attn_logit_softcapping", c["attn_logit_softcapping"], "transformers' Gemma 3 never "
                        "applies it, so a model trained with it would not export as trained; supported: null")
    if gemma3:
        full = {"rope_theta": c.get("rope_theta", 1e6), **(c.get("rope_scaling") or {}), **rope.get(FULL, {})}
        local = {"rope_theta": c.get("rope_local_base_freq", 1e4), **rope.get(SLIDING, {})}
        (theta, factor), (local_theta, _) = _rope(path, full, "rope_parameters", True), _rope(path, local,
                                                                                            "rope_parameters", False)
    else:
        theta, factor = _rope(path, {"rope_theta": c.get("rope_theta", 1e4), **rope}, "rope_parameters", False)
        local_theta = theta
    window = c.get("sliding_window") or 0
    kinds = c.get("layer_types")
    if not kinds:
        pattern = c.get("sliding_window_pattern", 6) if gemma3 else 2
        kinds = [SLIDING if (i + 1) % pattern else FULL for i in range(c["num_hidden_layers"])]
    if SLIDING in kinds and window <= 0:
        raise bad_value(path, "sliding_window", c.get("sliding_window"), "sliding layers need a window > 0")
    return dict(vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"], n_heads=heads,
                n_kv_heads=c.get("num_key_value_heads") or heads, ffn_hidden=c["intermediate_size"],
                max_seq_len=c.get("max_position_embeddings", 8192), rope_theta=float(theta),
                norm_eps=float(c.get("rms_norm_eps", 1e-6)), head_dim=c.get("head_dim") or 256,
                sliding_window=window, query_pre_attn_scalar=float(c.get("query_pre_attn_scalar", 256)),
                attn_softcap=float(c.get("attn_logit_softcapping") or 0.0),
                final_softcap=float(c.get("final_logit_softcapping") or 0.0), layer_types=tuple(kinds),
                rope_local_theta=float(local_theta), rope_factor=factor, qk_norm=gemma3)


def hf_fields(cfg: GemmaConfig, *, dtype: str, bos_token_id: int | None, eos_token_id: int | None,
              pad_token_id: int | None, arch: str) -> dict[str, Any]:
    """Keyword arguments both of transformers' Gemma text config classes take for ``cfg``."""
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.ffn_hidden,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=_number(cfg.query_pre_attn_scalar),
                sliding_window=cfg.sliding_window or None, layer_types=list(cfg.layer_types),
                attn_logit_softcapping=cfg.attn_softcap or None, final_logit_softcapping=cfg.final_softcap or None,
                tie_word_embeddings=True, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                pad_token_id=pad_token_id, architectures=[arch], dtype=dtype)


def gemma3_from_hf_name(name: str) -> str | None:
    """A Gemma 3 checkpoint's tensor name as ours; None for the vision tower (left out) and for the
    tied head a 4.x vision-language checkpoint may still hold."""
    if name.startswith(VISION_PREFIXES) or name in ("lm_head.weight", "language_model.lm_head.weight"):
        return None
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name[len("model."):] if name.startswith("model.") else name


def causal_lm_of(hf_class: str, config_class: str, config: dict[str, Any]) -> nn.Module:
    """transformers' ``hf_class`` of a config.json dict (PEFT's export)."""
    import transformers

    return getattr(transformers, hf_class)(getattr(transformers, config_class).from_dict(config))


def _number(x: float) -> int | float:
    """An integral value as an int (transformers' config classes type-check ``query_pre_attn_scalar``)."""
    return int(x) if float(x).is_integer() else x
