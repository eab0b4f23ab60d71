"""The mixed-precision step: where the compute dtype is applied, and what the masters start from.

Ordering rule (the one place it is written down):

1. Activation checkpointing and tensor parallelism first (they wrap or shard fp32 modules).
2. ``apply_mixed_precision`` next, *before* ``apply_zero``: stages 0-2 compute in the 16-bit
   dtype on the parameters themselves, so the model is cast here, and this rank's fp32 local
   shards are kept first: the fp32 master weights start from them, not from rounded copies.
3. ``apply_zero`` last.  Stage 3 is the exception: FSDP2 keeps fp32 shards (they *are* the
   masters) and casts per all-gather through its MixedPrecisionPolicy, so step 2 does nothing.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deepshard.core.dtensor_utils import local_tensor
from deepshard.core.zero.layout import local_shard

__all__ = ["apply_mixed_precision"]


def apply_mixed_precision(model: nn.Module, dp_mesh: DeviceMesh, *, zero_stage: int,
                          dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Cast ``model`` to ``dtype`` for ZeRO stages 0-2 and return this rank's fp32 master shards
    (per trainable parameter, as the stage will own them); None where nothing changes (fp32, stage 3)."""
    if zero_stage == 3 or dtype == torch.float32:
        return None
    world, rank = dp_mesh.size(), dp_mesh.get_local_rank()
    masters = [
        (local_tensor(p.data) if zero_stage == 0 else local_shard(local_tensor(p.data), world, rank)).clone()
        for p in model.parameters() if p.requires_grad
    ]
    model.to(dtype)
    return masters
