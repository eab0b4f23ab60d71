"""One ZeRO stage over parameters sharded in different groups: MoE experts under expert parallelism.

With ``parallel.ep`` each rank holds only its experts, so their ZeRO group is the dp ranks left after
ep (``edp``), not dp: stages 0-2 then run one bucketed stage per group, which a
:class:`~deepshard.core.zero.composite.CompositeStage` shows the optimizer as one (their tensors
concatenated, dense first).  Replication stays per part: an expert shard is held by no other rank of the world at stages 1-2, and by the ``edp`` ranks
at stage 0, which is what each part's own ``replication()`` says of its group.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from deepshard.core.config import ZeroConfig


@dataclass(frozen=True)
class ExpertLayout:
    """Where each rank's expert rows sit in the canonical ``[num_experts, ...]`` tensors, for layout-free
    checkpoints: ``mesh`` is the ``(ep, edp)`` grid (ep outer: ep group rank r holds experts
    ``r*L .. r*L+L-1``, its edp ranks split those L rows as ZeRO does) and ``names`` the expert params'
    clean FQNs.  A checkpoint then records each shard's global offset, so it loads at any ep."""

    mesh: DeviceMesh
    names: frozenset[str]


def expert_layout(ep_mesh: DeviceMesh, edp_mesh: DeviceMesh, grid: DeviceMesh, names: set[str]) -> ExpertLayout:
    """:class:`ExpertLayout` from the ``(edp, ep)`` sub-mesh ``grid`` (the root mesh's order), transposed
    to ``(ep, edp)`` without a process group (DCP needs only each rank's coordinate)."""
    assert grid.mesh_dim_names == ("edp", "ep") and grid.size() == ep_mesh.size() * edp_mesh.size()
    mesh = DeviceMesh(grid.device_type, grid.mesh.t().contiguous(), mesh_dim_names=("ep", "edp"),
                      _init_backend=False)
    return ExpertLayout(mesh, frozenset(names))


def check_experts(config: ZeroConfig, *, dtype: str = "fp32", hsdp: bool = False, offload_params: bool = False) -> None:
    """Refuse, before start, what expert-parallel sharding is not built with (ValueError naming the key)."""
    if config.stage != 3 and dtype != "fp32":
        raise ValueError(f"precision.dtype={dtype} with parallel.ep > 1 needs zero.stage=3 (got zero.stage="
                         f"{config.stage}): the fp32 masters of experts sharded over their own group are built "
                         f"for FSDP2 only; use zero.stage=3 or precision.dtype=fp32")
    refused = (("zero.quantized_weights", config.quantized_weights, "ZeRO++'s qwZ all-gather"),
               ("zero.quantized_gradients", config.quantized_gradients, "ZeRO++'s qgZ reduce-scatter"),
               ("parallel.dp_replicate", hsdp, "HSDP"),
               ("offload.params", offload_params, "parameter offload"))
    for key, on, what in refused:
        if on:
            raise ValueError(f"{key} with parallel.ep > 1: {what} is not built for experts sharded over their own "
                             f"group; turn {key} off or use parallel.ep=1")
