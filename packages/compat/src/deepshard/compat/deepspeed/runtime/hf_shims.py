"""DeepSpeed module contents the HF stack reads, where DeepSpeed's layout and ours differ:
``deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`` (accelerate tells a DeepSpeed scheduler from a
torch one by class name) and ``deepspeed.checkpoint.utils.clone_tensors_for_torch_save`` (accelerate's
``get_state_dict`` at ZeRO 0-2).  Served under those names by ``deepshard.compat.provide_deepspeed``."""

from __future__ import annotations

from typing import Any

import torch

# DeepSpeed 0.19.8's names (deepspeed/runtime/lr_schedules.py)
VALID_LR_SCHEDULES = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """DeepSpeed's: a copy of ``item`` (tensors, and lists/tuples/dicts of them) whose tensors are
    clones on ``device``, so saving it does not write the storage views share."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


__all__ = ["VALID_LR_SCHEDULES", "clone_tensors_for_torch_save"]
