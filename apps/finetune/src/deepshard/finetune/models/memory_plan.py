"""A model's memory plan: parameter counts (LoRA too), the largest ZeRO-3 unit, the ZeRO-Infinity
buffers, and model-state bytes per rank by the README's ZeRO table (core's ``expected_bytes``); the
estimate CLI and the config's checks use it.  The model comes from its config's family (the
registry), built on the meta device; units are its ``layers`` and the rest (the root)."""


from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from deepshard.core.memory import expected_bytes
from deepshard.finetune.models.registry import build_meta

OFFLOADS = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class Estimate:
    """Per-rank bytes of model states by residence, for one stage and offload choice."""

    stage: int
    offload: str
    offload_params: bool | str  # False/'none', True/'cpu' (FSDP2 CPU offload), 'nvme' (ZeRO-Infinity)
    device: int
    host: int
    nvme: int

    @property
    def options(self) -> str:
        out = f"+zero=stage{self.stage}"
        if self.offload != "none":
            out += f" +offload={self.offload}"
        params = {True: "cpu", False: "none"}.get(self.offload_params, self.offload_params)
        return out + (f" offload.params={params}" if params != "none" else "")


def count_params(model_cfg, lora=None) -> int:
    """Trainable parameters of the model config, built on the meta device (``lora``: a LoraConfig,
    then the adapters and the modules to save only)."""
    from deepshard.finetune.models.lora import count_lora_params

    model = build_meta(model_cfg)
    if lora is not None:
        return count_lora_params(model, lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def largest_unit(model_cfg, *, tiled: bool = False) -> int:
    """Parameters of the largest ZeRO-3 unit all-gathered whole: one block, or the root (embeddings,
    final norm, head; ``tiled``: the final norm only, the vocabulary ops run in tiles)."""
    model = build_meta(model_cfg)
    block = sum(p.numel() for p in model.layers[0].parameters()) if len(model.layers) else 0
    vocab = sum(p.numel() for m in (model.embed_tokens, model.lm_head) for p in m.parameters()) if tiled else 0
    return max(block, sum(p.numel() for p in model.parameters()) - len(model.layers) * block - vocab)


def unit_shards(model_cfg, world: int, *, tiled: bool = False, gathered: bool = False) -> list[int]:
    """Elements of each ZeRO-3 unit's shard on one rank (the root, then each block; ``tiled``: the
    embedding and the head are units of their own) as ``offload.params=nvme`` lays them out: FSDP2
    pads every param's dim 0 to a multiple of ``world``, and the swap places the padded shards
    (``slot_offsets``).  ``gathered``: only the units all-gathered whole (not a tiled embedding or
    head, which are read in rows): those the parameter pool holds."""
    from deepshard.offload.units import slot_offsets

    model = build_meta(model_cfg)
    own = [list(m.parameters()) for m in (model.embed_tokens, model.lm_head)] if tiled else []
    in_blocks = {id(p) for block in model.layers for p in block.parameters()} | {id(p) for u in own for p in u}
    units = [[p for p in model.parameters() if id(p) not in in_blocks]] + ([] if gathered else own) + [
        list(b.parameters()) for b in model.layers]
    out = []
    for params in units:
        rows = [p.shape[0] if p.dim() else 1 for p in params]
        _, pos = slot_offsets(-(-r // world) * (p.numel() // max(r, 1)) for p, r in zip(params, rows))
        if pos:  # a root that owns no params itself is no FSDP unit
            out.append(pos)
    return out


class InfinityBuffers(NamedTuple):
    """Host buffers of ``offload.params=nvme`` per rank, in bytes, as allocated (untouched pages of a
    pool buffer may never become resident: an upper bound on what they cost)."""

    pool: int  # param_buffer_count buffers of 4 B per element of the largest gathered unit
    deferred: int  # the deferred AdamW step's min(buffer_count, pieces) buffers of 16 B per piece element
    tiles: int = 0  # a tiled embedding/head's param and gradient tile buffers (rows of the shard)

    @property
    def peak(self) -> int:
        """All at once: the step's updates are owed from ``step()`` through the next forward (each runs
        at its unit's unshard), so the forward holds the deferred buffers beside the pool; they are
        freed at the first unit's backward (kept throughout when ``buffer_count >= pieces``)."""
        return self.pool + self.deferred + self.tiles


def infinity_buffers(model_cfg, *, world: int, param_buffer_count: int, buffer_count: int,
                     tiled: bool = False, sub_group_size: int = 2**24, buffer_size: int = 2**24,
                     tile_rows: int = 0) -> InfinityBuffers:
    """What ``ParamSwap`` (pool: the largest gathered unit's shard), ``InfinityStore``/``DeferredStep``
    (param, exp_avg, exp_avg_sq and grad regions per buffer, each a piece of ``min(sub_group_size,
    buffer_size)`` elements) and the tiled units' row buffers (``tile_rows`` gathered rows per tile)
    allocate, each region rounded up to the O_DIRECT alignment."""
    from deepshard.offload.aio import align_up
    from deepshard.offload.pieces import PIECE_ALIGN

    shards = unit_shards(model_cfg, world, tiled=tiled)
    gathered = unit_shards(model_cfg, world, tiled=tiled, gathered=True)
    size = max(PIECE_ALIGN, min(sub_group_size, buffer_size) // PIECE_ALIGN * PIECE_ALIGN)
    piece = min(size, -(-max(shards, default=1) // PIECE_ALIGN) * PIECE_ALIGN)  # deferred_step.piece_size
    pieces = sum(-(-n // piece) for n in shards)
    tiles = 0
    if tiled and tile_rows:  # a param and a gradient buffer of one tile's rows plus the alignment
        tiles = 2 * (align_up(4 * -(-tile_rows // world) * model_cfg.dim) + 4096)
    return InfinityBuffers(param_buffer_count * align_up(max(gathered, default=1) * 4),
                           min(buffer_count, pieces) * 4 * align_up(piece * 4), tiles)


def count_frozen(model_cfg, lora) -> int:
    """Under LoRA: the base parameters that are frozen (no grads, no optimizer state); 0 otherwise."""
    if lora is None:
        return 0
    from deepshard.finetune.models.lora import apply_lora

    model = build_meta(model_cfg)
    with torch.device("meta"):
        apply_lora(model, r=lora.r, alpha=lora.alpha, target_modules=lora.target_modules,
                   modules_to_save=lora.modules_to_save, seed=None)
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def estimate(num_params: int, *, stage: int, dp: int, dtype: str, offload: str = "none",
             offload_params: bool | str = False, nvme_buffer_bytes: int = 0, frozen_params: int = 0,
             param_buffer_bytes: int = 0) -> Estimate:
    """Where a rank's params, grads and optimizer state live for this choice (``num_params`` trainable
    per rank before data-parallel sharding, i.e. already divided by tp and pp).  ``param_buffer_bytes``:
    the host buffers of ``offload.params=nvme`` at their peak, the forward (:class:`InfinityBuffers`):
    the param pool plus the deferred step's buffers, whatever the model's size.  ``frozen_params``
    (a LoRA base): params only, in the compute dtype at stages 0-2, fp32 shards at stage 3 (FSDP2)."""
    e = expected_bytes(stage, num_params, dp, dtype)
    frozen = 4 * frozen_params // dp if stage == 3 else (4 if dtype == "fp32" else 2) * frozen_params
    e.params += frozen
    device, host, nvme = e.params + e.grads + e.optimizer, 0, 0
    # offloaded: an fp32 master + two moments per sharded element (12 bytes; on a CPU-only host an fp32
    # master may alias the param, so that is an upper bound there)
    offloaded = 12 * num_params // dp
    if offload == "cpu":  # the Adam step runs on the host
        device, host = device - e.optimizer, host + offloaded
    elif offload == "nvme":  # in swap files, streamed through a few host buffers
        device, nvme, host = device - e.optimizer, nvme + offloaded, host + min(nvme_buffer_bytes, offloaded)
    if offload_params == "nvme":  # params (the fp32 masters), grads and moments in swap files: 16 B/elt
        states = 16 * num_params // dp + 4 * frozen_params // dp
        return Estimate(stage, offload, "nvme", 0, param_buffer_bytes, states)
    if offload_params:  # FSDP2 CPUOffloadPolicy: sharded params and their grads rest on the host
        device, host = device - e.params - e.grads, host + e.params + e.grads
    return Estimate(stage, offload, offload_params, device, host, nvme)


def all_estimates(num_params: int, *, dp: int, dtype: str, nvme_buffer_bytes: int = 0,
                  frozen_params: int = 0, param_buffer_bytes: int = 0) -> list[Estimate]:
    """Every stage x offload choice (optimizer offload needs stage >= 1, parameter offload stage 3)."""
    out = []
    for stage in range(4):
        for offload in OFFLOADS:
            if offload != "none" and stage == 0:
                continue
            choices: tuple = (False, True) if stage == 3 and offload != "none" else (False,)
            for params in choices + (("nvme",) if stage == 3 and offload == "nvme" else ()):
                out.append(estimate(num_params, stage=stage, dp=dp, dtype=dtype, offload=offload,
                                    offload_params=params, nvme_buffer_bytes=nvme_buffer_bytes,
                                    frozen_params=frozen_params, param_buffer_bytes=param_buffer_bytes))
    return out
