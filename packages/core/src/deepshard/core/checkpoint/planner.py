"""The planner every save runs with."""

from __future__ import annotations

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner


class ModuleOrderPlanner(DefaultSavePlanner):
    """DCP's own planner, with each tensor that several ranks hold (a replicated parameter: ZeRO-0's model
    and optimizer state) written by the lowest of them, not by whichever rank had written least.  DCP's
    metadata lists tensors plan by plan, so rank 0's plan, holding every key in the module's order, makes
    the checkpoint's order the module's: what DeepSpeed's flat partitions (``to_deepspeed``) are laid out
    by.  (Load-balanced, a world-2 ZeRO-0 save listed ``layers.1.self_attn.o_proj`` before ``layers.0``.)"""

    def __init__(self) -> None:
        super().__init__(dedup_save_to_lowest_rank=True)
