"""A model's counts for the memory estimates: trainable and frozen parameters (LoRA too), the largest
ZeRO-3 unit and every unit's shard as the parameter swap lays it out (offload's ``unit_numel``).
The model comes from its config's family (the registry), built on the meta device; units are its
``layers`` and the rest (the root).  What each count costs is stated by the packages that allocate
it (core's and offload's ``memory``); ``working_set`` adds them up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepshard.finetune.models.registry import build_meta
from deepshard.offload import OffloadConfig
from deepshard.offload.memory import HostBuffers, host_buffers, unit_numel


@dataclass(frozen=True)
class ModelCounts:
    """Elements of one rank's model before data-parallel sharding, and its ZeRO-3 units at ``world``."""

    num_params: int  # trainable, already divided by tp x pp
    frozen: int = 0  # a LoRA base's frozen parameters (in the compute dtype / fp32 shards)
    nf4: int = 0  # a QLoRA base's block Linear weights, stored as NF4 (not in ``frozen``)
    largest_unit: int = 0  # the largest unit all-gathered whole
    units: tuple[int, ...] = ()  # every unit's shard (root, tiled units, blocks)
    gathered: tuple[int, ...] = ()  # the units gathered whole (not a tiled embedding or head)
    largest_tensor: int = 0  # the largest parameter's elements (a checkpoint load reads its slice of it)
    optimizer_states: int | None = None  # the update rule's state bytes (/ tp x pp); None: AdamW's fp32 moments


def optimizer_state_bytes(model: nn.Module, optim: Any, lora: Any = None) -> int:
    """Bytes of the states ``optim`` (an OptimConfig) keeps for ``model``'s trainable parameters: core's
    rule over their names and shapes (Muon: one momentum per hidden matrix; bf16 states: half).  Under
    LoRA the trainable factors (and modules to save) all take AdamW, as Muon's split says."""
    from deepshard.core.memory import rule_state_bytes
    from deepshard.core.optim import rule_for

    if lora is not None:
        from dataclasses import replace

        from deepshard.finetune.models.lora import count_lora_params

        return rule_state_bytes(rule_for(replace(optim, name="adamw"), [], []), [count_lora_params(model, lora)])
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rule = rule_for(optim, [n for n, _ in named], [tuple(p.shape) for _, p in named])
    return rule_state_bytes(rule, [p.numel() for _, p in named])


def model_counts(model_cfg: Any, lora: Any = None, *, tp: int = 1, pp: int = 1, world: int = 1,
                 tiled: bool = False, optim: Any = None) -> ModelCounts:
    """The counts of ``model_cfg`` (``lora``: a LoraConfig) for a run at ``world`` data-parallel ranks
    (``optim``: an OptimConfig, whose update rule's states are counted)."""
    model = build_meta(model_cfg)
    states = None if optim is None else optimizer_state_bytes(model, optim, lora) // (tp * pp)
    nf4 = 0
    if lora is not None and getattr(lora, "base_quant", "none") == "nf4":
        from deepshard.finetune.models.qlora import count_nf4

        nf4 = count_nf4(model_cfg)
    return ModelCounts(num_params=count_params(model_cfg, lora) // (tp * pp), nf4=nf4,
                       frozen=count_frozen(model_cfg, lora) - nf4,
                       largest_unit=_largest_unit(model, tiled), units=tuple(_unit_shards(model, world, tiled)),
                       gathered=tuple(_unit_shards(model, world, tiled, gathered=True)),
                       largest_tensor=max((p.numel() for p in model.parameters()), default=0),
                       optimizer_states=states)


def count_params(model_cfg: Any, lora: Any = None) -> int:
    """Trainable parameters of the model config, built on the meta device (``lora``: a LoraConfig,
    then the adapters and the modules to save only)."""
    from deepshard.finetune.models.lora import count_lora_params

    model = build_meta(model_cfg)
    if lora is not None:
        return count_lora_params(model, lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def largest_unit(model_cfg: Any, *, tiled: bool = False) -> int:
    """Parameters of the largest ZeRO-3 unit all-gathered whole: one block, or the root (embeddings,
    final norm, head; ``tiled``: the final norm only, the vocabulary ops run in tiles)."""
    return _largest_unit(build_meta(model_cfg), tiled)


def _largest_unit(model: nn.Module, tiled: bool) -> int:
    block = sum(p.numel() for p in model.layers[0].parameters()) if len(model.layers) else 0
    vocab = sum(p.numel() for m in (model.embed_tokens, model.lm_head) for p in m.parameters()) if tiled else 0
    return max(block, sum(p.numel() for p in model.parameters()) - len(model.layers) * block - vocab)


def unit_shards(model_cfg: Any, world: int, *, tiled: bool = False, gathered: bool = False) -> list[int]:
    """Elements of each ZeRO-3 unit's shard on one rank (the root, then each block; ``tiled``: the
    embedding and the head are units of their own) as ``offload.params=nvme`` lays them out.
    ``gathered``: only the units all-gathered whole (not a tiled embedding or head, which are read in
    rows): those the parameter pool holds."""
    return _unit_shards(build_meta(model_cfg), world, tiled, gathered=gathered)


def _unit_shards(model: nn.Module, world: int, tiled: bool, *, gathered: bool = False) -> list[int]:
    own = [list(m.parameters()) for m in (model.embed_tokens, model.lm_head)] if tiled else []
    in_blocks = {id(p) for block in model.layers for p in block.parameters()} | {id(p) for u in own for p in u}
    units = [[p for p in model.parameters() if id(p) not in in_blocks]] + ([] if gathered else own) + [
        list(b.parameters()) for b in model.layers]
    out = []
    for params in units:
        pos = unit_numel(((p.shape[0] if p.dim() else 1, p.numel()) for p in params), world)
        if pos:  # a root that owns no params itself is no FSDP unit
            out.append(pos)
    return out


def offload_buffers(model_cfg: Any, config: OffloadConfig, *, world: int, tile_rows: int = 0) -> HostBuffers:
    """The offload stores' host buffers for this model (offload's ``host_buffers`` on its units)."""
    tiled = bool(tile_rows)
    return host_buffers(config, state_numel=count_params(model_cfg) // world,
                        units=unit_shards(model_cfg, world, tiled=tiled),
                        gathered=unit_shards(model_cfg, world, tiled=tiled, gathered=True),
                        tile_rows=tile_rows, tile_width=model_cfg.dim, world=world)


def count_frozen(model_cfg: Any, lora: Any) -> int:
    """Under LoRA: the base parameters that are frozen (no grads, no optimizer state); 0 otherwise."""
    if lora is None:
        return 0
    from deepshard.finetune.models.lora import apply_lora

    model = build_meta(model_cfg)
    with torch.device("meta"):
        apply_lora(model, r=lora.r, alpha=lora.alpha, target_modules=lora.target_modules,
                   modules_to_save=lora.modules_to_save, seed=None)
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)
