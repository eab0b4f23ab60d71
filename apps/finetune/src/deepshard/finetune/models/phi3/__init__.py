"""The Phi-3 family (Phi-3, Phi-3.5, Phi-4, Phi-4-mini: ``model_type: phi3``): the Llama decoder with
Phi-4-mini's partial rotary, ``longrope`` RoPE scaling (short/long factors, the attention factor) and
Phi-3-mini's sliding window, registered as ``"phi3"``.  Its checkpoints fuse ``qkv_proj`` and
``gate_up_proj``, which it splits on load and fuses on export (``models/phi3/hf.py`` says why).
Dropout (``resid_pdrop``, ``embd_pdrop``, ``attention_dropout``) is refused unless 0.  Its activation
memory is the decoder's (``models/llama/memory.py``: the fused projections never exist in the forward,
partial rotary keeps nothing more, the window's mask is counted), measured for Phi-3 by
tests/sp/test_sp_estimate.py."""

from __future__ import annotations

import math
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
    refuse_switches,
    rope_of,
)
from deepshard.finetune.models.phi3.hf import check_dir, fuse, load_weights
from deepshard.finetune.models.registry import HFAdapter

HF_ARCH = "Phi3ForCausalLM"
ROPE_TYPES = {"default": "default", "longrope": "longrope", "su": "longrope", "yarn": "longrope"}  # HF's aliases


@dataclass(frozen=True)
class Phi3Config(LlamaConfig):
    pass


def _longrope(path: str | Path, c: dict[str, Any], rope: dict[str, Any], rotary_dim: int) -> dict[str, Any]:
    """longrope's fields as transformers computes them: the attention factor given, or from
    factor = max_position_embeddings / original_max_position_embeddings."""
    original = rope.get("original_max_position_embeddings") or c.get("original_max_position_embeddings")
    if not original:
        raise bad_value(path, "original_max_position_embeddings", original, "longrope needs it (> 0)")
    for key in ("short_factor", "long_factor"):
        if len(rope.get(key) or ()) != rotary_dim // 2:
            raise bad_value(path, f"rope_parameters.{key}", rope.get(key), f"longrope needs {rotary_dim // 2} "
                            f"factors (rotary dims / 2)")
    factor = rope.get("factor") or c.get("max_position_embeddings", 2048) / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dict(rope_short_factor=tuple(rope["short_factor"]), rope_long_factor=tuple(rope["long_factor"]),
                rope_original_max=int(original), rope_attention_factor=float(attention))


def config_from_hf(path: str | Path) -> Phi3Config:
    """Our Phi3Config from a Phi-3 ``config.json``."""
    c = read_config(path, ("phi3",))
    for key in ("resid_pdrop", "embd_pdrop", "attention_dropout"):
        if c.get(key):
            raise bad_value(path, key, c[key], "dropout is not applied here: only 0 is supported")
    rope_type, rope = rope_of(c)
    if rope_type not in ROPE_TYPES:
        raise bad_value(path, "rope_type", rope_type, f"supported: {sorted(ROPE_TYPES)}")
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    fields = decoder_fields(path, {**c, "rope_scaling": None, "rope_parameters": {"rope_theta": theta}})
    head_dim = fields["head_dim"] or fields["dim"] // fields["n_heads"]
    partial = float(rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
    fields["rotary_dim"] = int(head_dim * partial)
    if ROPE_TYPES[rope_type] == "longrope":
        fields.update(_longrope(path, c, rope, fields["rotary_dim"]))
    return Phi3Config(**fields, sliding_window=c.get("sliding_window") or 0)


def config_dict(cfg: Phi3Config, *, dtype: str = "float32", bos_token_id: int | None = None,
                eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict[str, Any]:
    """A ``config.json`` for Phi3ForCausalLM describing ``cfg`` (built by transformers itself)."""
    from transformers import Phi3Config as HFPhi3Config

    refuse_switches(cfg, "phi3", sliding_window=True)
    fields = hf_fields(cfg, dtype=dtype, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                       pad_token_id=pad_token_id, arch=HF_ARCH)
    if cfg.head_dim != cfg.dim // cfg.n_heads:
        raise ValueError(f"model.head_dim={cfg.head_dim}: Phi3ForCausalLM's heads are dim / n_heads = "
                         f"{cfg.dim // cfg.n_heads}")
    del fields["head_dim"]
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim}
    if cfg.rope_original_max:
        rope.update(rope_type="longrope", short_factor=list(cfg.rope_short_factor),
                    long_factor=list(cfg.rope_long_factor), original_max_position_embeddings=cfg.rope_original_max,
                    attention_factor=cfg.rope_attention_factor)
    return HFPhi3Config(**{**fields, "rope_parameters": rope}, sliding_window=cfg.sliding_window or None,
                        original_max_position_embeddings=cfg.rope_original_max or cfg.max_seq_len).to_dict()


def causal_lm(config: dict[str, Any]) -> nn.Module:
    """transformers' Phi3ForCausalLM of a config.json dict."""
    from transformers import Phi3Config as HFPhi3Config
    from transformers import Phi3ForCausalLM

    return Phi3ForCausalLM(HFPhi3Config.from_dict(config))


ADAPTER = HFAdapter(model_types=("phi3",), config_from_hf=config_from_hf, config_dict=config_dict,
                    causal_lm=causal_lm, load_weights=load_weights, check_dir=check_dir, fuse=fuse,
                    chat_template="phi3")
SPEC = decoder_spec("phi3", Phi3Config, ADAPTER)
__all__ = ["SPEC", "Phi3Config"]
