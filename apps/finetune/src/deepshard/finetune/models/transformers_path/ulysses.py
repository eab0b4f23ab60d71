"""Ulysses sequence parallelism (``parallel.sp``) on the transformers path, as DeepSpeed's ALST does it:
our attention function registered with transformers' ``AttentionInterface`` and selected for the model
(``set_attn_implementation``), so transformers' own modeling code runs unchanged around it.

Each sp rank runs the model on its consecutive slice of every row (the app's stepper slices
``input_ids``, ``labels`` and ``doc_ids`` as for the native families).  transformers computes q/k/v
and RoPE per token, with the global positions the model hands it (:class:`TransformersLM` under
sp); the registered function turns q/k/v into whole sequences for ``heads / sp`` heads (the native
families' all-to-alls, models/attention.py), runs transformers' own ``sdpa_attention_forward`` on
them, and turns the output back to the rank's tokens.  transformers builds no mask for an attention
name it does not know: the model passes the whole row's document mask (4-D, kept as is) or none
(SDPA's own causal mask over the whole sequence).

What this cannot run is refused before start (:func:`check_sp`): attention that does not go through
the interface (transformers' own test of the modeling source), and masks or biases that transformers
would build per layer (sliding windows, soft-capping, ALiBi).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deepshard.finetune.models.attention import ulysses_heads, ulysses_tokens
from deepshard.finetune.models.ulysses import apply_ulysses
from deepshard.finetune.models.ulysses import check_sp as check_heads

NAME = "deepshard_ulysses"  # the attention implementation's name in transformers' registry
# config keys whose masks or biases transformers makes per layer, which the whole-row mask here lacks
_PER_LAYER = ("sliding_window", "attn_logit_softcapping", "alibi")


class _Groups:
    """``module`` with another ``num_key_value_groups``: kv heads repeated to line up with sp's head
    chunks (expand_kv_heads) change how many q heads each kv head serves."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q [b, hq, s/N, d], k, v [b, hkv, s/N, d] of this rank's tokens
    -> ([b, s/N, hq, d], None), attending over the whole sequence through ``module.sp_group``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    late = [k for k in ("sliding_window", "softcap", "position_bias") if kwargs.get(k) is not None]
    assert not late, f"{type(module).__name__} passes {late} to attention: refused by check_sp before start"
    group = module.sp_group
    q, k, v = ulysses_heads(query, key, value, group)
    groups = q.shape[1] // k.shape[1]
    target = module if getattr(module, "num_key_value_groups", 1) == groups else _Groups(module, groups)
    out, _ = sdpa_attention_forward(target, q, k, v, attention_mask, **kwargs)  # [b, s, hq/N, d]
    return ulysses_tokens(out.transpose(1, 2), group).transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, ulysses_attention)


def check_sp(cfg: Any, arch_class: type, *, sp: int, tp: int = 1) -> None:
    """ValueError, before start, unless ``arch_class`` (transformers' causal LM of ``cfg``) can run
    Ulysses through the attention interface at ``sp``."""
    if sp <= 1:
        return
    if tp > 1:
        raise ValueError(f"parallel.sp={sp} with parallel.tp={tp}: the transformers path ({cfg.arch}) runs "
                         f"sequence parallelism without tensor parallelism (untested together); use tp=1 with sp")
    can_set = getattr(arch_class, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        raise ValueError(f"parallel.sp={sp}: {cfg.arch}'s attention does not go through transformers' attention "
                         f"interface, where the transformers path puts Ulysses' all-to-alls; use parallel.sp=1")
    d = cfg.hf_dict
    layer_types = set(d.get("layer_types") or ())
    used = [k for k in _PER_LAYER if d.get(k) and not (k == "sliding_window" and d.get("use_sliding_window") is False)]
    if used or layer_types - {"full_attention"}:
        key = used[0] if used else f"layer_types={sorted(layer_types)}"
        raise ValueError(f"parallel.sp={sp}: {cfg.arch} sets {key}, a mask or bias transformers builds per layer, "
                         f"which the transformers path's sequence parallelism does not (it masks whole rows: "
                         f"causal, within documents); use parallel.sp=1")
    check_heads(cfg, sp=sp, tp=tp)


def attention_modules(hf: nn.Module) -> list[nn.Module]:
    """The modules that call the attention interface: transformers' own heuristic, ``*Attention*`` classes."""
    return [m for m in hf.modules() if "Attention" in type(m).__name__]


def apply_sequence_parallel(model: nn.Module, sp_mesh: DeviceMesh) -> None:
    """``model`` (a :class:`TransformersLM`) attends through :data:`NAME` over ``sp_mesh``; its forward
    then hands transformers global positions and the whole row's mask.  In place; nothing at sp=1."""
    if sp_mesh.size() == 1:
        return
    check_sp(model.cfg, type(model.hf), sp=sp_mesh.size())
    _register()
    attentions = attention_modules(model.hf)
    assert attentions, f"{model.cfg.arch}: no *Attention* module"
    for m in attentions:
        m.sp_group = None  # set by apply_ulysses, with the model's own (its forward reads it)
    apply_ulysses(model, sp_mesh)  # the groups, and the whole row's doc_ids gathered before forward
    model.hf.set_attn_implementation(NAME)
    assert model.hf.config._attn_implementation == NAME, (model.cfg.arch, model.hf.config._attn_implementation)
