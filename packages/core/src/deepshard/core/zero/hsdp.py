"""HSDP: ZeRO-3 sharded within groups of ``parallel.dp_shard`` ranks and replicated across
``parallel.dp_replicate`` groups (torchtitan's and Accelerate's hybrid sharding).

FSDP2 takes the 2-D ``(dp_replicate, dp_shard)`` mesh directly: parameters are
``(Replicate(), Shard(0))`` DTensors, all-gathers and reduce-scatters run inside a shard group (a
"node"), and one all-reduce per unit crosses the groups.  Everything else (data, loss counts,
checkpoints) sees the flattened ``dp`` axis that :func:`deepshard.core.mesh.build_mesh` also names.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from deepshard.core.config import ZeroConfig

__all__ = ["check_hpz", "check_hsdp", "hpz_reshard", "hsdp_mesh"]


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


def check_hpz(size: int, *, shard_size: int, hsdp: bool = False, offload_params: bool = False) -> None:
    """Refuse, before start, an hpZ partition that cannot work (ValueError naming the key)."""
    if size == 1:
        return
    key = f"zero.hpz_partition_size={size}"
    if hsdp:
        raise ValueError(f"{key} with HSDP (parallel.dp_replicate > 1): HSDP's shard group is one node already, "
                         f"so backward's all-gathers stay inside it; use one of the two")
    if offload_params:
        raise ValueError(f"{key} with offload.params: the secondary partition is a device copy; use one of the two")
    if shard_size % size or size > shard_size:
        raise ValueError(f"{key} does not divide the ZeRO group's {shard_size} ranks: use a divisor of {shard_size} "
                         f"(ranks per node)")


def hpz_reshard(config: ZeroConfig, shard_mesh: DeviceMesh, *, offload_params: bool = False) -> bool | int:
    """FSDP2's ``reshard_after_forward`` for ZeRO++'s hpZ: ``zero.hpz_partition_size`` ranks per
    secondary partition (FSDP2 reshards to that many consecutive ranks after forward, so backward
    all-gathers inside them), or the plain switch when hpZ is off."""
    size = config.hpz_partition_size
    if size == 1:
        return config.reshard_after_forward
    check_hpz(size, shard_size=shard_mesh.size(), hsdp=shard_mesh.ndim > 1, offload_params=offload_params)
    return True if size == shard_mesh.size() else size
