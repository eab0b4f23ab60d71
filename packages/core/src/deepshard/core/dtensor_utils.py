"""Small helpers over DTensor parameters (tensor parallel) that every package may use.

Public: the pipeline and the app call these rather than reaching into ZeRO's internals.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["copy_global", "dtensor_replication", "like_param", "local_slices", "local_tensor", "param_shard",
           "storage_bytes"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a DTensor (tensor parallel), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def param_shard(p: torch.Tensor) -> torch.Tensor:
    """``local_tensor(p.data)`` for a step's hot path: a Parameter(DTensor)'s ``.data`` and ``to_local()``
    each build a new wrapper (~50 us per parameter measured here, paid per parameter by every step's
    parameter norm); the DTensor's own local tensor, detached, is the same elements at no such cost."""
    return p._local_tensor.detach() if isinstance(p, DTensor) else p.data


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages behind ``t``: a DTensor's local shard; a wrapper subclass (torchao's NF4Tensor, a
    QLoRA base) has none of its own, so its inner tensors' (codes, scales) instead."""
    t = local_tensor(t)
    if t.device.type == "meta":
        return []
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [s for name in names for s in _storages(getattr(t, name))]
    return [t.untyped_storage()]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local shard), each once;
    meta tensors hold none."""
    seen: dict[int, int] = {}
    for t in tensors:
        for s in _storages(t):
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def dtensor_replication(p: torch.Tensor) -> int:
    """Ranks holding an identical copy of ``p``'s local tensor on the mesh ``p`` lives on (1 if plain)."""
    if not isinstance(p, DTensor):
        return 1
    n = 1
    for size, placement in zip(p.device_mesh.shape, p.placements):
        if placement.is_replicate():
            n *= size
    return n


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``'s local piece, laid out as ``p``'s.  Under tensor parallelism torch may hand a parameter a
    gradient of other placements (the vocab-parallel embedding, Shard(0), gets a Replicate one under bf16
    compute): it is redistributed to the parameter's placements first (Replicate to Shard is a local
    slice, no communication); the stages then find the rows they own where they look for them."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        g = g.redistribute(p.device_mesh, p.placements)
    return local_tensor(g)


def like_param(p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Wrap a local gradient as a DTensor when the param is one (tensor parallel), else ``g`` itself."""
    if isinstance(p, DTensor):
        return DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return g


def local_slices(dst: torch.Tensor) -> tuple[slice, ...]:
    """The region of ``dst``'s global value that this rank holds, one slice per dim: all of it for a
    plain tensor; a DTensor's shard (ZeRO-3's dim-0 rows, the uneven last shard included; TP's rows or
    columns), so a reader can fetch only those elements from a file."""
    if not isinstance(dst, DTensor):
        return tuple(slice(0, n) for n in dst.shape)
    shape, offset = compute_local_shape_and_global_offset(dst.shape, dst.device_mesh, dst.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def copy_global(dst: torch.Tensor, value: torch.Tensor) -> None:
    """Write a full value into ``dst``; a sharded DTensor (ZeRO-3 built on meta) takes its piece only,
    so a sharded model gets exactly the weights the single-process model gets."""
    if isinstance(dst, DTensor):
        dst.to_local().copy_(value[local_slices(dst)])
    else:
        dst.copy_(value)
