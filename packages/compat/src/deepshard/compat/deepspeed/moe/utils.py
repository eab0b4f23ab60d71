"""``deepspeed.moe.utils``: which parameters are experts', and the optimizer groups DeepSpeed's MoE scripts build.

An expert parameter carries ``allreduce=False`` and a ``group_name`` (``moe.layer.MoE`` sets them), as
in DeepSpeed.  :func:`split_params_into_different_moe_groups_for_optimizer` moves them out of each
group into groups of their own (``moe=True``, ``name=<group_name>``, the other keys copied), at most
``max_group_size`` elements each, appended after the original groups.  Here the engine does not read
the ``moe`` flag: the optimizer treats those groups as any other (their expert parameters are already
per-rank under ``ep_size > 1``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["has_moe_layers", "is_moe_param", "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's test: an expert parameter is one marked ``allreduce=False``."""
    return getattr(param, "allreduce", True) is False


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether ``m`` holds a ``moe.layer.MoE``, the first one's number of experts)."""
    from .layer import MoE

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def split_params_into_shared_and_expert_params(params: list[nn.Parameter]) -> tuple[list, list]:
    """(the shared parameters, the expert parameters) of ``params``, in their order."""
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def _chunks(params: list[nn.Parameter], max_size: float) -> list[list[nn.Parameter]]:
    out: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        if not out or size + p.numel() > max_size:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
        max_group_size: float | None = 178956971) -> list[dict[str, Any]]:
    """The groups with their expert parameters moved into MoE groups of their own (see the module docstring)."""
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif not isinstance(param_groups, list):
        raise ValueError(f"param_groups: a dict or a list/tuple of dicts, got {type(param_groups).__name__}")
    moe_groups: list[dict[str, Any]] = []
    for group in param_groups:
        params = list(group["params"])
        names: list[str] = []
        for p in params:
            if is_moe_param(p) and p.group_name not in names:
                names.append(p.group_name)
        for name in names:
            experts = [p for p in params if is_moe_param(p) and p.group_name == name]
            for part in _chunks(experts, max_group_size) if max_group_size is not None else [experts]:
                moe_groups.append({**group, "name": name, "moe": True, "params": part})
        group["params"] = [p for p in params if not is_moe_param(p)]
    return param_groups + moe_groups
