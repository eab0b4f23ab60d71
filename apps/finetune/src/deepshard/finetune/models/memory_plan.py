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
    experts: int = 0  # parallel.ep > 1: this rank's expert parameters (1/ep of the model's, in num_params)
    expert_states: int | None = None  # the update rule's bytes for those experts (then not in optimizer_states)


def optimizer_state_bytes(model: nn.Module, optim: Any, lora: Any = None, *, only: set[int] | None = None) -> int:
    """Bytes of the states ``optim`` (an OptimConfig) keeps for ``model``'s trainable parameters: core's
    rule over their names and shapes (Muon: one momentum per hidden matrix; bf16 states: half).  Under
    LoRA the trainable factors (and modules to save) all take AdamW, as Muon's split says.  ``only``:
    count just the parameters of these ids (the rule still sees every name: Muon's split is the model's)."""
    from deepshard.core.memory import rule_state_bytes
    from deepshard.core.optim import rule_for

    if lora is not None:
        from dataclasses import replace

        from deepshard.finetune.models.lora import count_lora_params

        return rule_state_bytes(rule_for(replace(optim, name="adamw"), [], []), [count_lora_params(model, lora)])
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rule = rule_for(optim, [n for n, _ in named], [tuple(p.shape) for _, p in named])
    return rule_state_bytes(rule, [p.numel() if only is None or id(p) in only else 0 for _, p in named])


def shard_experts(model: nn.Module, ep: int) -> list[nn.Module]:
    """Keep expert group 0 of ``ep`` in every sparse layer of a (meta) model, as ``parallel.ep`` does on
    each rank (``models/moe_ep.py``); returns the expert modules (none: a dense model)."""
    experts = [m.experts for m in model.modules() if hasattr(m, "ep_group")]  # models/moe.py's SparseMoe
    for module in experts:
        if ep > 1:
            module.shard(0, ep)
    return experts


def model_counts(model_cfg: Any, lora: Any = None, *, tp: int = 1, pp: int = 1, world: int = 1,
                 tiled: bool = False, optim: Any = None, ep: int = 1) -> ModelCounts:
    """The counts of ``model_cfg`` (``lora``: a LoraConfig) for a run at ``world`` data-parallel ranks
    (``optim``: an OptimConfig, whose update rule's states are counted).  ``ep`` > 1: one rank's model
    under expert parallelism (its ``num_experts / ep`` experts; ZeRO-3's units as they gather: the
    experts over ``world / ep`` ranks, the rest over ``world``)."""
    model = build_meta(model_cfg)
    if ep > 1 and lora is None:  # (LoRA on experts is refused; under LoRA they are frozen, counted whole)
        return _ep_counts(model, model_cfg, tiled=tiled, optim=optim, ep=ep, world=world)
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


def _ep_counts(model: nn.Module, model_cfg: Any, *, tiled: bool, optim: Any, ep: int, world: int) -> ModelCounts:
    """:func:`model_counts` of one rank's model under ``parallel.ep`` (tp = pp = 1: MoE refuses them)."""
    ids = {id(p) for m in shard_experts(model, ep) for p in m.parameters()}
    experts = sum(p.numel() for p in model.parameters() if id(p) in ids)
    dense = [p for p in model.parameters() if id(p) not in ids]
    states = expert_states = None
    if optim is not None:
        expert_states = optimizer_state_bytes(model, optim, only=ids)
        states = optimizer_state_bytes(model, optim, only={id(p) for p in dense})
    shards = _expert_shards(model, world // ep, ids)

    def with_experts(units: list[int]) -> tuple[int, ...]:  # the blocks are the last units
        head = units[:len(units) - len(shards)]
        return tuple(head + [u + e for u, e in zip(units[len(head):], shards, strict=True)])

    return ModelCounts(num_params=sum(p.numel() for p in model.parameters()), experts=experts,
                       largest_unit=_largest_unit(model, tiled),
                       units=with_experts(_unit_shards(model, world, tiled, skip=ids)),
                       gathered=with_experts(_unit_shards(model, world, tiled, gathered=True, skip=ids)),
                       largest_tensor=max((p.numel() for p in model.parameters()), default=0),
                       optimizer_states=states, expert_states=expert_states)


def _expert_shards(model: nn.Module, edp: int, ids: set[int]) -> list[int]:
    """Per block: its experts' shard over the ``edp`` ranks left after ep."""
    blocks = [[p for p in b.parameters() if id(p) in ids] for b in model.layers]
    return [unit_numel(((p.shape[0], p.numel()) for p in ps), edp) if ps else 0 for ps in blocks]


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


def _unit_shards(model: nn.Module, world: int, tiled: bool, *, gathered: bool = False,
                 skip: set[int] = frozenset()) -> list[int]:
    own = [list(m.parameters()) for m in (model.embed_tokens, model.lm_head)] if tiled else []
    in_blocks = {id(p) for block in model.layers for p in block.parameters()} | {id(p) for u in own for p in u}
    units = [[p for p in model.parameters() if id(p) not in in_blocks]] + ([] if gathered else own) + [
        [p for p in b.parameters() if id(p) not in skip] for b in model.layers]
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
