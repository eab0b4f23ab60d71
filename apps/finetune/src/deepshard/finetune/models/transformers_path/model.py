"""Any causal LM through transformers' own modeling code: the model a ``config.json`` names, built by
transformers itself (``from_config``) with its parameters on the meta device, behind the interface
the app's recipe expects of a family's model (``init_weights``, ``forward(input_ids, labels, doc_ids,
reduction)``, ``layers``).

The loss is ours, not the model's: the summed token loss over labels != -100 (already aligned,
``labels[t]`` is the token after ``t``, as the native families take them), which the engine divides by
the step's global valid-token count.  transformers' own loss is a mean per forward (and shifts the
labels itself), so it is not token-weighted across micro-batches and ranks.

Buffers (rotary frequencies, masks) are computed by the model's own ``__init__`` on the host while
the parameters go to the meta device; a copy is kept and written back by ``init_weights``, because
materializing (``to_empty``) leaves every tensor uninitialized.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from deepshard.core.parallelize import IGNORE_INDEX
from deepshard.core.sequence_parallel import shard_sequence
from deepshard.finetune.models.attention import doc_causal_mask

WRAPPER = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper adds this to names


@dataclass(frozen=True)
class TransformersConfig:
    """A causal LM that no native family reads: its ``config.json`` (as JSON text, so the config stays
    frozen and a checkpoint's manifest keeps it) and the counts the app's estimates read."""

    hf_config: str  # the config.json, JSON text
    arch: str  # transformers' class, e.g. GPTNeoXForCausalLM
    vocab_size: int = 0
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    ffn_hidden: int = 0
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    kernels: str = "torch"  # the native families' kernels: transformers' code runs its own
    mlp_tiles: int = 1
    loss_chunk_size: int = 0  # the logits exist whole: transformers' head computes them
    vocab_tile_size: int = 0  # no vocabulary tiling on this path

    def __post_init__(self) -> None:
        if self.mlp_tiles != 1:
            raise ValueError(f"model.mlp_tiles={self.mlp_tiles}: the transformers path ({self.arch}) runs the "
                             f"model's own MLP, which is not tiled; use model.mlp_tiles=1")
        if self.loss_chunk_size or self.vocab_tile_size:
            raise ValueError(f"model.loss_chunk_size={self.loss_chunk_size}, model.vocab_tile_size="
                             f"{self.vocab_tile_size}: the transformers path computes whole logits; use 0")

    @property
    def hf_dict(self) -> dict[str, Any]:
        return json.loads(self.hf_config)

    @property
    def head_dim(self) -> int:
        """The config's own ``head_dim`` where it gives one, else dim / heads (MFU's attention FLOPs read it)."""
        return int(self.hf_dict.get("head_dim") or self.dim // max(self.n_heads, 1))


def hf_config_object(cfg: TransformersConfig) -> Any:
    """transformers' config object of ``cfg`` (its own config class, by model_type)."""
    from transformers import CONFIG_MAPPING

    d = cfg.hf_dict
    return CONFIG_MAPPING[d["model_type"]].from_dict(d)


def causal_lm_class(arch: str) -> type:
    import transformers

    return getattr(transformers, arch)


@contextmanager
def _params_on_meta() -> Iterator[None]:
    """Parameters are created on the host and moved to meta one by one (accelerate's
    ``init_empty_weights(include_buffers=False)``); buffers stay real, computed by the model itself."""
    register = nn.Module.register_parameter

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = to_meta  # type: ignore[method-assign]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def _single_block_list(model: nn.Module, block_types: set[str]) -> nn.ModuleList | None:
    """The one ModuleList holding every block (GPT-2's ``h``, GPT-NeoX's and OLMo2's ``layers``)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)
             and all(type(c).__name__ in block_types for c in m)]
    return lists[0] if len(lists) == 1 else None


class TransformersLM(nn.Module):
    """transformers' ``cfg.arch`` under ``self.hf`` (our parameter names are ``hf.`` + transformers'),
    its parameters on the meta device until materialized, with our token-weighted loss."""

    def __init__(self, cfg: TransformersConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # on meta (the app's build): parameters there, buffers real; elsewhere transformers' own init
        with _params_on_meta() if torch.get_default_device().type == "meta" else nullcontext():
            self.hf = causal_lm_class(cfg.arch)(hf_config_object(cfg))
        # (module, buffer name, value): written back after materializing (to_empty keeps no values)
        self._buffer_init = [(m, k, b.detach().clone()) for m in self.hf.modules()
                             for k, b in m._buffers.items() if b is not None]
        block_types = set(getattr(self.hf, "_no_split_modules", None) or ())
        self._blocks_list = _single_block_list(self.hf, block_types)
        self._blocks = [m for m in self.hf.modules() if type(m).__name__ in block_types]
        self.sp_group = None  # Ulysses' group (transformers_path/ulysses.py): forward then gives global positions

    @property
    def layers(self) -> nn.ModuleList:
        """The blocks (the modules ``_no_split_modules`` names) as one ModuleList (the estimates' units)."""
        return self._blocks_list if self._blocks_list is not None else nn.ModuleList(self._blocks)

    @property
    def blocks(self) -> nn.ModuleList | list[nn.Module]:
        """What ZeRO-3 wraps one by one and activation checkpointing may wrap (a ModuleList only)."""
        return self._blocks_list if self._blocks_list is not None else list(self._blocks)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, *, weights: bool = True) -> None:
        """The buffers the model computed at build, back in place; the parameters come from the
        checkpoint (``model=hf``: this path always loads one).  A plain model's tied head, which
        ``to_empty`` untied, is tied again (ZeRO-3's sharded model keeps the tie)."""
        del seed, weights  # every parameter is loaded: nothing is drawn
        for module, name, value in self._buffer_init:
            module._buffers[name].copy_(value)
        head, embed = self.hf.get_output_embeddings(), self.hf.get_input_embeddings()
        if self.cfg.tie_embeddings and head is not None and head.weight is not embed.weight:
            head.weight = embed.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if input_ids.is_meta:  # counting FLOPs on meta: a ready 4-D causal mask (transformers' own mask
            # code reads values, which meta tensors have none of)
            s = input_ids.shape[1]
            kwargs["attention_mask"] = torch.ones(s, s, dtype=torch.bool, device="meta").tril().expand(
                input_ids.shape[0], 1, s, s)
        elif self.sp_group is not None:
            kwargs.update(_sequence_parallel_inputs(input_ids, doc_ids, self.sp_group))
        elif doc_ids is not None:  # positions restart per document: transformers masks packed sequences by them
            kwargs["position_ids"] = positions_in_documents(doc_ids)
        logits = self.hf(input_ids=input_ids, use_cache=False, **kwargs).logits
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction=reduction)


def _sequence_parallel_inputs(input_ids: torch.Tensor, doc_ids: torch.Tensor | None, group: Any) -> dict[str, Any]:
    """This sp rank's slice's global positions (restarting per document) and the whole row's mask:
    the document-causal one, 4-D so transformers keeps it as is, or none (causal over the whole row,
    SDPA's own).  ``doc_ids`` are the whole row's (apply_ulysses' pre-hook gathered them)."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    b, s = input_ids.shape
    if doc_ids is None:
        return {"position_ids": (torch.arange(s, device=input_ids.device) + r * s).expand(b, s)}
    return {"position_ids": shard_sequence(positions_in_documents(doc_ids), r, n),
            "attention_mask": doc_causal_mask(doc_ids)}


def positions_in_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] positions counted from each document's start (``doc_ids`` change at a start)."""
    seq = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(start, seq, torch.zeros_like(seq)).cummax(dim=1).values
    return seq - first


def canonical_names(model: nn.Module) -> dict[str, str]:
    """Every name a parameter has (tied ones have two; activation checkpointing's wrapper removed)
    -> the name ``named_parameters`` lists it by."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        out[name.replace(WRAPPER, "")] = first[id(p)]
    return out
