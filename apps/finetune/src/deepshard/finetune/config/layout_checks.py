"""The checks of a run's parallel layout that need the whole settings (pipeline schedule and split,
Ulysses sequence parallelism, MLP tiling, ZeRO-Infinity's parameter swap, HSDP and ZeRO++), each a
ValueError naming the keys, before any worker starts.  ``settings.validate`` calls them in order."""

from __future__ import annotations

import dataclasses
from typing import Any

from deepshard.core.mesh import ParallelDims
from deepshard.offload.config import OffloadConfig

# ``settings``: the app's ``config.settings.Settings``, not imported (it imports this module: no circle)
Settings = Any


def validate_pipeline_layout(settings: Settings) -> None:
    """pp runs: the schedule (over every micro-batch of a step: ``pipeline.microbatches x
    train.grad_accum``) and the split."""
    from deepshard.pipeline import validate_pipeline

    p, par = settings.pipeline, settings.parallel
    virtual = p.virtual_stages or (2 if p.schedule in ("interleaved_1f1b", "zero_bubble") else 1)
    validate_pipeline(schedule=p.schedule, pp=par.pp, microbatches=settings.micro_batches_per_step,
                      virtual_stages=virtual, num_layers=settings.model.n_layers, partition=p.partition)


def validate_sp(settings: Settings) -> None:
    """Ulysses sequence parallelism (``parallel.sp`` > 1): the sequence and the heads split evenly, and
    what it does not compose with, said before any worker starts."""
    from deepshard.finetune.models.ulysses import check_sp

    par = settings.parallel
    par.resolve(settings.world_size)  # sp must divide the world first: the rest would mislead
    if par.pp > 1:
        raise ValueError(f"parallel.sp={par.sp} with parallel.pp={par.pp}: not supported (the pipeline's "
                         "stages and micro-batches are not sliced per sequence-parallel rank); use pp=1 with sp")
    if settings.offload.params == "nvme":
        raise ValueError(f"offload.params='nvme' with parallel.sp={par.sp}: not supported (untested); use "
                         "offload.params=cpu or none with sp")
    check_sp(settings.model, sp=par.sp, tp=par.tp, seq_len=settings.data.seq_len)


def check_mlp_tiles(settings: Settings) -> None:
    """``model.mlp_tiles``: at most one tile per token of a rank's slice of a row, and not under tp."""
    tiles, par, seq_len = settings.model.mlp_tiles, settings.parallel.resolve(settings.world_size), settings.data.seq_len
    if tiles > seq_len // par.sp:
        held = f"data.seq_len={seq_len} / parallel.sp={par.sp} = " if par.sp > 1 else "data.seq_len="
        raise ValueError(f"model.mlp_tiles={tiles} is larger than the sequence each rank holds ({held}"
                         f"{seq_len // par.sp} tokens): choose 1 to {seq_len // par.sp}")
    if tiles > 1 and par.tp > 1:
        raise ValueError(f"model.mlp_tiles={tiles} with parallel.tp={par.tp}: not supported (the tiled MLP "
                         "takes plain parameters, tp's are DTensors); use mlp_tiles=1 with tp")


def check_param_swap(settings: Settings, world: int) -> OffloadConfig:
    """Space and buffers for the parameter swap; returns the offload config the run uses: left out,
    ``param_buffer_size`` (DeepSpeed's cap on a swapped shard) follows the largest gathered
    unit's shard, the size the pool allocates anyway (a TinyLlama block is 22M elements a rank at
    world 2, over the 2**24 default); a given value must hold it."""
    from deepshard.finetune.models.memory_plan import count_params, unit_shards
    from deepshard.finetune.models.vocab_tiling import tile_rows
    from deepshard.offload.config import validate_param_swap

    per_rank = -(-count_params(settings.model) // world)
    par = settings.parallel  # ZeRO-3's vocabulary tiling makes the embedding and the head units of their own
    tiled = bool(tile_rows(settings.model, zero_stage=3, tp=par.tp, pp=par.pp, sp=getattr(par, "sp", 1)))
    unit = max(unit_shards(settings.model, world, tiled=tiled, gathered=True))  # tiled ones are read in rows
    offload = settings.offload
    if "param_buffer_size" in settings.offload_picks and unit > offload.param_buffer_size:
        offload = dataclasses.replace(offload, param_buffer_size=unit)
    # 16 B per element (param, grad, two moments), plus alignment slack per unit
    validate_param_swap(offload, 16 * per_rank + 2**20, unit, "the largest gathered unit: a block or the root")
    return offload


def validate_zeropp(settings: Settings, parallel: ParallelDims) -> None:
    """HSDP (``parallel.dp_replicate``) and ZeRO++'s quantized collectives (deepshard.core.zero.hsdp/quantized)."""
    from deepshard.core.zero.hsdp import check_hpz, check_hsdp

    check_hsdp(dp_replicate=parallel.dp_replicate, zero_stage=settings.engine.zero.stage, pp=parallel.pp,
               tp=parallel.tp, sp=parallel.sp)
    check_hpz(settings.engine.zero.hpz_partition_size, shard_size=parallel.dp_shard * parallel.sp,
              hsdp=parallel.dp_replicate > 1, offload_params=settings.offload.params != "none")
    zero = settings.engine.zero
    on = [k for k in ("quantized_weights", "quantized_gradients") if getattr(zero, k)]
    # ZeRO-3 shards over dp_shard x sp (core.mesh.zero_mesh: sequence-parallel ranks share the shards)
    # (fp32 training is not refused: int8 blocks cut its bytes 4x, bf16's 2x)
    if on and parallel.dp_shard * parallel.sp == 1:
        raise ValueError(f"zero.{on[0]}=true with a ZeRO-3 shard group of one rank (parallel.dp_shard=1 x "
                         f"parallel.sp=1, data-parallel size {parallel.dp}): no weight is all-gathered and no "
                         f"gradient reduce-scattered, so there is nothing to quantize; set it false")


def check_ep(settings: Settings, ep: int) -> None:
    """Expert parallelism (``parallel.ep`` > 1): an MoE model whose experts ep divides (the family's
    ``check_parallel``), ep dividing dp and none of the layouts it is not built with, before start."""
    from deepshard.core.zero.split import check_experts

    settings.parallel.resolve(settings.world_size)  # ep divides dp; not with pp/tp/sp/dp_replicate
    if not getattr(settings.model, "num_experts", 0):
        raise ValueError(f"parallel.ep={ep}: model {settings.model_name!r} has no experts; expert parallelism "
                         f"needs an MoE model (qwen3_moe, mixtral) or parallel.ep=1")
    check_experts(settings.engine.zero, dtype=settings.engine.precision.dtype,
                  offload_params=settings.offload.params != "none")


def check_padding(settings: Settings) -> None:
    """``data.pad_to_multiple_of``: null or 0 (off), else 1 to data.seq_len, on padded rows, and a length
    every layout can run (each sp rank's equal slice, an MLP tile per token, the pipeline's fixed shapes)."""
    m, d = settings.data.pad_to_multiple_of, settings.data
    if m is None or m == 0:
        return
    if isinstance(m, bool) or not isinstance(m, int) or not 0 < m <= d.seq_len:
        raise ValueError(f"data.pad_to_multiple_of={m}: must be null or 0 (off: every row padded to data.seq_len) "
                         f"or an integer from 1 to data.seq_len={d.seq_len}")
    if d.pack:
        raise ValueError(f"data.pad_to_multiple_of={m} with data.pack=true: packed windows are all data.seq_len="
                         f"{d.seq_len} tokens, nothing is padded; set data.pack=false or leave the key out")
    par = settings.parallel.resolve(settings.world_size)
    if par.pp > 1:
        raise ValueError(f"data.pad_to_multiple_of={m} with parallel.pp={par.pp}: the pipeline's stages take their "
                         "activation shapes from the first step, so every batch must be data.seq_len long; "
                         "leave the key out with pp")
    if m % par.sp:
        raise ValueError(f"data.pad_to_multiple_of={m} is not divisible by parallel.sp={par.sp}: each sp rank "
                         f"holds length/sp tokens of every batch; choose a multiple of {par.sp}")
    tiles = settings.model.mlp_tiles
    if tiles > min(m, d.seq_len) // par.sp:
        raise ValueError(f"data.pad_to_multiple_of={m} with model.mlp_tiles={tiles}: a batch may be {m} tokens "
                         f"long ({m // par.sp} per sp rank), fewer than one MLP tile per token; choose a multiple "
                         f">= {tiles * par.sp}")
