"""``deepspeed.utils.groups``: DeepSpeed's expert-parallel and expert-data-parallel process groups.

DeepSpeed's default topology (``_create_expert_and_data_parallel`` with ``mp_size`` 1, E + D): for
``ep_size`` E over W ranks, the expert-parallel groups are E consecutive ranks (``[0, 1], [2, 3]`` at
W=4, E=2: the all-to-all), the expert-data-parallel groups every E-th rank (``[0, 2], [1, 3]``: the
experts' gradient all-reduce), and the data-parallel group every rank (the dense params').  Groups are
named ``ep_size_<E>`` and made once per default process group, every rank making every group in
DeepSpeed's order (edp groups first, then ep groups).  ``moe.layer.MoE`` makes them when built (DeepSpeed
makes them in ``deepspeed.initialize``; the names answer earlier here, never later).  A destroyed and
destroyed group (a default group torn down and made again) drops the cached ones.  ``use_data_before_expert_parallel_`` (D + E) and an
``mpu`` (tensor/pipeline parallel groups) are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["initialize"]

_EXPERT_PARALLEL_GROUP: dict[str, Any] = {}
_EXPERT_PARALLEL_GROUP_RANKS: dict[str, list[int]] = {}
_EXPERT_DATA_PARALLEL_GROUP: dict[str, Any] = {}
_EXPERT_DATA_PARALLEL_GROUP_RANKS: dict[str, list[int]] = {}
mpu = None


def _fresh() -> None:
    """Forget groups that were destroyed since (a default group torn down, or a test's groups)."""
    live = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
    if any(g not in live for g in (*_EXPERT_PARALLEL_GROUP.values(), *_EXPERT_DATA_PARALLEL_GROUP.values())):
        for d in (_EXPERT_PARALLEL_GROUP, _EXPERT_PARALLEL_GROUP_RANKS, _EXPERT_DATA_PARALLEL_GROUP,
                  _EXPERT_DATA_PARALLEL_GROUP_RANKS):
            d.clear()


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """DeepSpeed 0.19.8's: deprecated, it raises (pass ``ep_size`` to ``moe.layer.MoE``)."""
    raise ValueError("deepspeed.utils.groups.initialize(): deprecated in DeepSpeed (it raises there too); pass the "
                     "desired ep_size to deepspeed.moe.layer.MoE(..., ep_size, ...)")


def _create_expert_and_data_parallel(expert_parallel_size_: int, mp_size: int | None = None,
                                     pp_size: int | None = None, mp_mode: str = "tp",
                                     use_data_before_expert_parallel_: bool = False, **_: Any) -> None:
    """Make the ``ep_size_<E>`` groups (once per default group; a collective: every rank calls)."""
    if use_data_before_expert_parallel_:
        raise ValueError("use_data_before_expert_parallel_=True: the D + E topology is not built; use the default "
                         "E + D (expert groups of consecutive ranks)")
    for key, value in (("mp_size", mp_size), ("pp_size", pp_size)):
        if value not in (None, 1):
            raise ValueError(f"{key}={value}: expert groups with model or pipeline parallelism are not built; use 1")
    if not dist.is_initialized():
        raise ValueError(f"ep_size={expert_parallel_size_}: expert groups need an initialized process group; call "
                         f"deepspeed.init_distributed() first")
    _fresh()
    world, rank, ep = dist.get_world_size(), dist.get_rank(), expert_parallel_size_
    if ep < 1 or world % ep:
        raise ValueError(f"ep_size={ep}: must divide the world size {world}")
    name = f"ep_size_{ep}"
    if name in _EXPERT_PARALLEL_GROUP:
        return
    for i in range(ep):  # DeepSpeed's order: the expert-data-parallel groups first
        ranks = list(range(i, world, ep))
        group = dist.new_group(ranks)
        if rank in ranks:
            _EXPERT_DATA_PARALLEL_GROUP[name], _EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = group, ranks
    for i in range(world // ep):
        ranks = list(range(i * ep, (i + 1) * ep))
        group = dist.new_group(ranks)
        if rank in ranks:
            _EXPERT_PARALLEL_GROUP[name], _EXPERT_PARALLEL_GROUP_RANKS[name] = group, ranks


def _known(group_name: str, table: dict[str, Any], what: str) -> Any:
    _fresh()
    if group_name not in table:
        raise ValueError(f"{what} group {group_name!r} is not initialized (made by moe.layer.MoE(ep_size=N) as "
                         f"'ep_size_N'; known: {sorted(table)})")
    return table[group_name]


def _get_expert_parallel_group(group_name: str) -> Any:
    return _known(group_name, _EXPERT_PARALLEL_GROUP, "expert parallel")


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    return _known(group_name, _EXPERT_PARALLEL_GROUP_RANKS, "expert parallel")


def _get_expert_data_parallel_group(group_name: str) -> Any:
    return _known(group_name, _EXPERT_DATA_PARALLEL_GROUP, "expert data parallel")


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    return _known(group_name, _EXPERT_DATA_PARALLEL_GROUP_RANKS, "expert data parallel")


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    _fresh()
    return _EXPERT_PARALLEL_GROUP


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    _fresh()
    return _EXPERT_DATA_PARALLEL_GROUP


def _get_max_expert_size() -> int | None:
    _fresh()
    sizes = [int(k.split("_")[2]) for k in _EXPERT_PARALLEL_GROUP]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(group=_get_expert_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return dist.get_rank(group=_get_expert_parallel_group(group_name))


def _get_expert_parallel_src_rank(group_name: str) -> int:
    size = _get_expert_parallel_world_size(group_name)
    return (dist.get_rank() // size) * size


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(group=_get_expert_data_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return dist.get_rank(group=_get_expert_data_parallel_group(group_name))


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    return _get_expert_data_parallel_group_ranks(group_name)[0]


def _get_data_parallel_group() -> Any:
    """Every rank (no mpu here): the dense params' group."""
    return dist.group.WORLD


def _get_data_parallel_group_ranks() -> list[int]:
    return list(range(dist.get_world_size()))


def _get_data_parallel_world_size() -> int:
    return dist.get_world_size()


def _get_data_parallel_rank() -> int:
    return dist.get_rank()


def _get_broadcast_src_rank() -> int:
    return 0


def _get_model_parallel_world_size() -> int:
    return 1


def _get_expert_model_parallel_world_size() -> int:
    return 1


def _get_sequence_parallel_world_size() -> int:
    return 1
