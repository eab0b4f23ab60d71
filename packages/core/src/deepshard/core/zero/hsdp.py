"""HSDP: ZeRO-3 sharded within groups of ``parallel.dp_shard`` ranks and replicated across
``parallel.dp_replicate`` groups (torchtitan's and Accelerate's hybrid sharding).

FSDP2 takes the 2-D ``(dp_replicate, dp_shard)`` mesh directly: parameters are
``(Replicate(), Shard(0))`` DTensors, all-gathers and reduce-scatters run inside a shard group (a
"node"), and one all-reduce per unit crosses the groups.  Everything else (data, loss counts,
checkpoints) sees the flattened ``dp`` axis that :func:`deepshard.core.mesh.build_mesh` also names.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["check_hsdp", "hsdp_mesh"]


def hsdp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The 2-D ``(dp_replicate, dp_shard)`` mesh ZeRO-3 shards over, or None for a flat ``dp``."""
    names = mesh.mesh_dim_names or ()
    if "dp_replicate" not in names or mesh["dp_replicate"].size() == 1:
        return None
    return mesh["dp_replicate", "dp_shard"]


def check_hsdp(*, dp_replicate: int, zero_stage: int, pp: int = 1, tp: int = 1, sp: int = 1) -> None:
    """Refuse, before start, what HSDP does not combine with (ValueError naming the keys)."""
    if dp_replicate == 1:
        return
    if zero_stage != 3:
        raise ValueError(f"parallel.dp_replicate={dp_replicate} needs zero.stage=3 (got zero.stage={zero_stage}): "
                         f"HSDP is FSDP2's hybrid sharding of ZeRO-3; stages 0-2 shard over the flat dp axis")
    for key, value in (("pp", pp), ("tp", tp), ("sp", sp)):
        if value > 1:  # untested compositions are refused rather than guessed at
            raise ValueError(f"parallel.dp_replicate={dp_replicate} with parallel.{key}={value}: HSDP does not "
                             f"combine with pipeline, tensor or sequence parallelism yet; use parallel.dp_replicate=1")
