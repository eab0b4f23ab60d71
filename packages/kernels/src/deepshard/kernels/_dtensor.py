"""Small DTensor helpers: the kernels run on local shards, so placements are checked first.

A kernel that reduces over a dimension (RMSNorm over hidden, cross-entropy over vocab) would give a
silently wrong answer on a shard of that dimension, so such placements raise ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # DTensor is public from torch 2.5; keep the package importable without it
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]
    Partial = Replicate = Shard = None  # type: ignore[assignment,misc]


def is_dtensor(x: Any) -> bool:
    return DTensor is not None and isinstance(x, DTensor)


def check_placements(
    kernel: str,
    arg: str,
    x: Any,
    *,
    forbidden_dims: tuple[int, ...] = (),
    allow_shard: bool = True,
    allow_partial: bool = False,
    why: str = "",
) -> None:
    """Raise ``ValueError`` naming the kernel, argument and placement when ``x`` is placed unsupportedly.

    ``forbidden_dims`` may be negative (counted from the end of ``x``'s dims).
    """
    if not is_dtensor(x):
        return
    forbidden = {d % x.ndim for d in forbidden_dims}
    for placement in x.placements:
        bad = False
        if isinstance(placement, Partial):
            bad = not allow_partial
        elif isinstance(placement, Shard):
            bad = (not allow_shard) or (placement.dim % x.ndim) in forbidden
        if bad:
            raise ValueError(
                f"kernels.{kernel}: {arg} has placements {tuple(x.placements)}, which this kernel cannot "
                f"compute on locally{': ' + why if why else ''}; redistribute it first"
            )


def same_mesh(kernel: str, *xs: Any) -> None:
    meshes = {x.device_mesh for x in xs if is_dtensor(x)}  # DeviceMesh equality: same ranks and dims, not the same object
    if len(meshes) > 1:
        raise ValueError(f"kernels.{kernel}: DTensor arguments live on different device meshes")


def to_local(x: Any) -> torch.Tensor:
    return x.to_local() if is_dtensor(x) else x


def like(local: torch.Tensor, ref: Any) -> Any:
    """Wrap ``local`` as a DTensor placed like ``ref`` (elementwise results keep their inputs' layout)."""
    if not is_dtensor(ref):
        return local
    return DTensor.from_local(
        local, ref.device_mesh, ref.placements, run_check=False, shape=ref.shape, stride=ref.stride()
    )
