"""ZeRO-3's embedding and LM head in vocabulary tiles: never gathered whole (``model.vocab_tile_size``).

Under ZeRO-3 the root unit (embeddings, final norm, head) is all-gathered whole at every forward and
backward, and at a real vocabulary it is the largest unit by far (an 8B model with a 128K
vocabulary: 1.05B of its parameters), so it sizes every gathered buffer, every gradient and every swap buffer.  :func:`apply_vocab_tiling`
gives the embedding and the head FSDP2 units of their own whose forward is never called: it sets the
model's ``embed_fn``/``head_loss_fn`` to read their ``Shard(0)`` weights and run
``deepshard.core.zero.tiled_vocab`` on them (tiles of ``tile_size`` vocabulary rows gathered, used and
freed; the tile's gradient reduce-scattered into the shard), so FSDP2 never gathers them.  Their
gradients land on the sharded params' ``.grad`` as FSDP2's own do, averaged over the same group; a
parameter swap (``offload.params=nvme``) treats them as units read and written in rows, tile by tile
(``shard_io``: their shard is never whole in memory).

``model.vocab_tile_size``: -1 (auto: on under ZeRO-3 where it applies, 4096 rows per tile), 0 (off:
the root unit gathers them as before), or rows per gathered tile.  It applies without tensor or
pipeline parallelism, sequence parallelism or tied embeddings; elsewhere the model runs as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from deepshard.core.dtensor_utils import local_tensor
from deepshard.core.parallelize import IGNORE_INDEX
from deepshard.core.zero.tiled_vocab import tiled_embedding, tiled_linear_cross_entropy

AUTO_TILE_ROWS = 4096  # gathered rows per tile under auto: [4096, dim] of the weight at a time


@dataclass
class VocabTiling:
    """Set on the embedding and the head by :func:`apply_vocab_tiling`; read by the tiled ops it installs
    on the model, and by offload's parameter swap (which then reads and writes them in rows)."""

    rows_per_rank: int  # rows of each rank's shard per tile (the gathered tile: world x this)
    dtype: torch.dtype  # the compute dtype (FSDP2's param_dtype): tiles are cast to it as gathered


def tile_rows(cfg, *, zero_stage: int, tp: int = 1, pp: int = 1, sp: int = 1) -> int:
    """Gathered rows per tile for this run, 0 where tiling is off or does not apply."""
    size = cfg.vocab_tile_size
    if size == 0 or zero_stage != 3 or tp > 1 or pp > 1 or sp > 1 or cfg.tie_embeddings:
        return 0
    return AUTO_TILE_ROWS if size < 0 else size


def model_tile_rows(model: nn.Module, mesh: DeviceMesh, zero_stage: int) -> int:
    """:func:`tile_rows` for a model (or a pipeline stage: 0 unless it holds both the embedding and the
    head) on ``mesh`` (axes it lacks count as size 1)."""
    if getattr(model, "embed_tokens", None) is None or getattr(model, "lm_head", None) is None:
        return 0
    names = mesh.mesh_dim_names or ()
    size = {axis: mesh[axis].size() if axis in names else 1 for axis in ("tp", "pp", "sp")}
    return tile_rows(model.cfg, zero_stage=zero_stage, **size)


def apply_vocab_tiling(model: nn.Module, dp_mesh: DeviceMesh, *, rows: int, param_dtype: torch.dtype,
                       reduce_dtype: torch.dtype = torch.float32) -> int:
    """Before ZeRO-3 shards the root: the embedding and the head become FSDP2 units of their own that
    the tiled ops read shard by shard, installed as the model's ``embed_fn``/``head_loss_fn``.
    Returns their parameters' elements (the Ψ the root's count then misses as shards)."""
    world = dp_mesh.size()
    numel = 0
    for module in (model.embed_tokens, model.lm_head):
        numel += sum(p.numel() for p in module.parameters() if p.requires_grad)
        fully_shard(module, mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype,
                                                                          reduce_dtype=reduce_dtype),
                    reshard_after_forward=True)
        module.vocab_tiling = VocabTiling(rows_per_rank=-(-rows // world), dtype=param_dtype)
    model.embed_fn = partial(_embed, model.embed_tokens)
    model.head_loss_fn = partial(_head_loss, model.lm_head, chunk_size=model.cfg.loss_chunk_size)
    return numel


def sharded_numel(model: nn.Module) -> int:
    """Local elements of the tiled units' params (what a Ψ count over local shards saw of them)."""
    return sum(local_tensor(p.data).numel() for m in (model.embed_tokens, model.lm_head)
               for p in m.parameters() if p.requires_grad)


def _shard_io(module: nn.Module):
    return getattr(module, "shard_io", None)  # set by offload's parameter swap after this: read per call


def _embed(module: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The embedding in tiles (the model's ``embed_fn``): its FSDP2 unit is never all-gathered."""
    tiling = module.vocab_tiling
    return tiled_embedding(input_ids, module.weight, tile_size=tiling.rows_per_rank, dtype=tiling.dtype,
                           shard_io=_shard_io(module))


def _head_loss(module: nn.Module, h: torch.Tensor, labels: torch.Tensor, reduction: str, *,
               chunk_size: int) -> torch.Tensor:
    """The head fused with the loss in tiles (the model's ``head_loss_fn``): never gathered whole."""
    tiling = module.vocab_tiling
    return tiled_linear_cross_entropy(h.flatten(0, 1).to(tiling.dtype), module.weight, labels.flatten(),
                                      ignore_index=IGNORE_INDEX, reduction=reduction,
                                      tile_size=tiling.rows_per_rank, chunk_size=chunk_size or 1024,
                                      shard_io=_shard_io(module))
