"""What a checkpoint holds, and what one save captures when it is asked for (no I/O, no collective).

Every tensor is a DTensor over the dp mesh with its true placement: the fp32 master weights (under
``model.<fqn>``) and the update rule's states (AdamW's ``optim.exp_avg.<fqn>``, ...) are Shard(0) at stages 1-3 and
Replicate at stage 0, so DCP records each chunk's global offset and a checkpoint loads at any world
size and stage.  Keys are stage-agnostic (wrapper prefixes such as ``_checkpoint_wrapped_module.`` are
dropped).  Offloaded state (host or NVMe stores) stays where it lives: its DTensors sit on a host
mirror of the mesh.  A :class:`SaveRequest` is one save's state, scalars and RNG, written by
``state.write_checkpoint`` now (a synchronous save) or by ``async_save``'s writer from a staged copy.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from deepshard.core.checkpoint.failures import rank_and_world
from deepshard.core.checkpoint.json_state import rng_state
from deepshard.core.optim import ZeroOptimizer

__all__ = ["FRESH_STATE_DICT", "SaveRequest", "checkpoint_bytes", "clean_name", "fresh_keys", "held", "mesh_on",
           "save_request", "state_kinds", "tied_aliases", "training_state", "unsupported_reason"]

WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
# A state store whose ``state_dict`` returns tensors made for the caller (read from its files, kept by no
# one else, never updated in place) sets this class attribute True: an asynchronous save then adopts them
# instead of copying them into its staging buffers (one copy of the state instead of two at the first
# save, none held between saves).  Stores that return views of their live state leave it unset.
FRESH_STATE_DICT = "state_dict_is_fresh"


def state_kinds(optimizer: ZeroOptimizer) -> tuple[tuple[str, str], ...]:
    """``(store key, checkpoint key prefix)``: the master under ``model.``, each state the update rule
    names under ``optim.<state>.`` (AdamW: ``optim.exp_avg.``, ``optim.exp_avg_sq.``)."""
    return (("master", "model."), *((s, f"optim.{s}.") for s in optimizer.store.rule.states))


def held(optimizer: ZeroOptimizer, kind: str, index: int) -> bool:
    """Whether param ``index`` has a ``kind`` to save (Muon keeps a momentum on its matrices and AdamW's
    moments on the rest: each param's checkpoint holds only the states its update uses)."""
    return kind == "master" or optimizer.store.rule.holds(kind, index)


def clean_name(name: str) -> str:
    """A parameter's FQN without wrapper modules, so keys do not depend on AC, compile or stage."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def unsupported_reason(optimizer: ZeroOptimizer) -> str | None:
    """Why this layout cannot be checkpointed yet (None when it can): tensor-parallel params at
    stages 1-2 would need a strided dp-over-tp placement that is not built here."""
    stage = optimizer.stage
    if stage.expert_parallel and getattr(stage, "expert_layout", None) is None:
        return "MoE experts split over parallel.ep > 1 without their layout (zero.split.ExpertLayout)"
    if 0 < stage.zero_stage < 3 and any(isinstance(p, DTensor) for p in stage.params):
        return "tensor-parallel parameters at zero stages 1-2 (use zero.stage=0 or 3 with parallel.tp > 1)"
    return None


_HOST_MESHES: dict[tuple, DeviceMesh] = {}


def mesh_on(mesh: DeviceMesh, device_type: str) -> DeviceMesh:
    """``mesh``'s layout on ``device_type`` (no process group: DCP only needs each rank's coordinate).

    DTensor.from_local moves a tensor to its mesh's device, so offloaded (host) state gets a host
    mirror of the compute mesh and is saved and loaded in host memory, never copied to the GPU.
    """
    if mesh.device_type == device_type:
        return mesh
    key = (device_type, tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), mesh.mesh_dim_names)
    if key not in _HOST_MESHES:
        _HOST_MESHES[key] = DeviceMesh(device_type, mesh.mesh, mesh_dim_names=mesh.mesh_dim_names,
                                       _init_backend=False)
    return _HOST_MESHES[key]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _as_dtensor(local: torch.Tensor, param: torch.Tensor, stage: int, dp_mesh: DeviceMesh,
                layout: Any = None) -> DTensor:
    """``local`` (this rank's state for ``param``) as a DTensor with the layout the stage gives it,
    on the device where ``local`` lives; ``layout``: the expert layout when ``param`` is an expert's."""
    if isinstance(param, DTensor) and layout is None:
        if 0 < stage < 3:
            raise NotImplementedError("checkpointing tensor-parallel params at zero stages 1-2: see unsupported_reason")
        return DTensor.from_local(local, mesh_on(param.device_mesh, local.device.type), param.placements,
                                  run_check=False, shape=param.shape, stride=param.stride())
    if layout is not None:  # this rank's rows of a canonical [num_experts, ...] expert tensor (zero.split)
        ep = layout.mesh.mesh.shape[0]  # (no sub-mesh slicing: the grid has no process groups)
        inner = param.placements[0] if isinstance(param, DTensor) else (Replicate() if stage == 0 else Shard(0))
        shape = (param.shape[0] * ep, *param.shape[1:])
        return DTensor.from_local(local, mesh_on(layout.mesh, local.device.type), [Shard(0), inner],
                                  run_check=False, shape=torch.Size(shape), stride=_contiguous_stride(shape))
    placement = Replicate() if stage == 0 or param.dim() == 0 else Shard(0)
    return DTensor.from_local(local, mesh_on(dp_mesh, local.device.type), [placement], run_check=False,
                              shape=param.shape, stride=param.stride())


def training_state(optimizer: ZeroOptimizer, dp_mesh: DeviceMesh, model: nn.Module | None = None) -> dict[str, Any]:
    """The DCP state dict: DTensor views of the store's tensors (a load writes into them in place).

    Params outside the optimizer (frozen weights, persistent buffers) of ``model`` are added as
    they are, so a partly frozen model still round-trips.
    """
    stage = optimizer.stage
    store_state = optimizer.store.state_dict()
    layout = getattr(stage, "expert_layout", None)
    experts = {clean_name(n) for n in layout.names} if layout is not None else set()
    out: dict[str, Any] = {}
    for i, (name, p) in enumerate(zip(stage.names, stage.params)):
        key = clean_name(name)
        for kind, prefix in state_kinds(optimizer):
            if held(optimizer, kind, i):
                out[prefix + key] = _as_dtensor(store_state[kind][i], p, stage.zero_stage, dp_mesh,
                                                layout if key in experts else None)
    if model is not None:
        trained = {clean_name(n) for n in stage.names}
        aliases = tied_aliases(model, trained)
        for name, t in model.state_dict().items():
            if clean_name(name) in aliases:  # a tied head: the trained tensor, saved once under its own name
                continue
            if clean_name(name) in experts and clean_name(name) not in trained:  # frozen experts: canonical too
                local = t.to_local() if isinstance(t, DTensor) else t
                out["model." + clean_name(name)] = _as_dtensor(local, t, stage.zero_stage if isinstance(t, DTensor)
                                                               else 0, dp_mesh, layout)
            elif clean_name(name) not in trained:
                out["model." + clean_name(name)] = t
    return out


def tied_aliases(model: nn.Module, trained: set[str]) -> set[str]:
    """Clean names under which ``model`` lists a trained parameter a second time (a head tied to the
    embedding): the checkpoint holds it once, under the trained name, whatever the pipeline layout (a
    pp=2 run's last stage holds its own copy and saves it under that name too)."""
    first: dict[int, str] = {}
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        key = clean_name(name)
        if first.setdefault(id(p), key) != key and first[id(p)] in trained:
            aliases.add(key)
    return aliases


def fresh_keys(optimizer: ZeroOptimizer) -> frozenset[str]:
    """The DCP keys whose tensors the store made for this save (:data:`FRESH_STATE_DICT`), else none."""
    if not getattr(optimizer.store, FRESH_STATE_DICT, False):
        return frozenset()
    return frozenset(prefix + clean_name(name) for i, name in enumerate(optimizer.stage.names)
                     for kind, prefix in state_kinds(optimizer) if held(optimizer, kind, i))


def checkpoint_bytes(state: dict[str, Any]) -> int:
    """Bytes DCP writes for ``state`` (each global tensor once, whatever its sharding)."""
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


@dataclass
class SaveRequest:
    """What one save writes, captured when it is asked for: the DCP state (the live tensors, or a staged
    copy of them for an asynchronous save), the JSON scalars and this rank's RNG states."""

    root: Path
    step: int
    state: dict[str, Any]
    trainer: dict[str, Any]
    rng: dict[str, Any]
    world: dict[str, Any]
    num_params: int
    meta: dict[str, Any] | None = None
    write_extra: Callable[[Path], None] | None = None
    fresh: frozenset[str] = frozenset()  # keys of ``state`` that are fresh tensors, adoptable by staging

    @property
    def nbytes(self) -> int:
        return checkpoint_bytes(self.state)


def save_request(root: str | os.PathLike, step: int, optimizer: ZeroOptimizer, dp_mesh: DeviceMesh, *,
                 model: nn.Module | None = None, app_state: dict[str, Any] | None = None,
                 meta: dict[str, Any] | None = None,
                 write_extra: Callable[[Path], None] | None = None) -> SaveRequest:
    """The save of ``step`` as of now (no I/O, no collective): see :func:`save_checkpoint`."""
    _, world = rank_and_world()
    return SaveRequest(
        root=Path(root), step=step, state=training_state(optimizer, dp_mesh, model), rng=rng_state(),
        trainer={"num_updates": optimizer.num_updates, "scaler": optimizer.scaler.state_dict(),
                 "app": app_state or {}, "world_size": world, "zero_stage": optimizer.stage.zero_stage},
        world={"world_size": world, "dp_size": dp_mesh.size(), "zero_stage": optimizer.stage.zero_stage},
        num_params=len(optimizer.stage.names), meta=meta, write_extra=write_extra, fresh=fresh_keys(optimizer))
