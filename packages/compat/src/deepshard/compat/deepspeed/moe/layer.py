"""``deepspeed.moe.layer.MoE``: refused, naming what to use instead.

DeepSpeed's MoE layer is expert parallelism: experts split over an expert-parallel process group
with all-to-all token dispatch, its own gate (top-k, capacity factor, token dropping, the
auxiliary load-balancing loss returned from forward) and expert-sharded checkpoints.  deepshard's
mesh has no expert axis (pp, dp, tp only), so the layer cannot keep DeepSpeed's meaning; an
emulation that replicated every expert would train differently (no token dropping by capacity
across ranks) and hold E times the memory.
"""

from __future__ import annotations

from typing import Any


class MoE:
    """Refused: see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("deepspeed.moe.layer.MoE: not supported: deepshard has no expert-parallel axis (its mesh "
                         "is pp x dp x tp), so DeepSpeed's all-to-all expert dispatch and capacity-based token "
                         "dropping cannot hold. Use a plain MoE module of your own (every rank holds all experts; "
                         "ZeRO-3 shards them like any other parameters) or train MoE models with DeepSpeed")


__all__ = ["MoE"]
