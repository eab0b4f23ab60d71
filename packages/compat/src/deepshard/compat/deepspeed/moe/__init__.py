"""``deepspeed.moe``: the MoE layer (``layer.MoE``), its gate (``sharded_moe``) and ``utils``."""

from . import layer, sharded_moe, utils

__all__ = ["layer", "sharded_moe", "utils"]
