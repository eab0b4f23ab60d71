"""``deepspeed.moe.layer.MoE``: DeepSpeed's MoE layer with its signature and return value.

``MoE(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor, min_capacity,
use_residual, noisy_gate_policy, drop_tokens, use_rts, ...)``; ``forward(hidden_states, used_token=None)``
returns ``(output, l_aux, exp_counts)``.  ``expert`` is copied ``num_experts / ep_size`` times on each
rank (parameter names ``deepspeed_moe.experts.deepspeed_experts.<i>.*``, the gate
``deepspeed_moe.gate.wg.weight``, as DeepSpeed names them).  Expert parameters carry DeepSpeed's
``allreduce=False`` and ``group_name="ep_size_<n>"``, which ``moe.utils`` reads.  ``use_residual``:
PR-MoE's residual, ``softmax(coefficient(x))`` mixing the MoE output and a dense copy of ``expert``.

With ``ep_size > 1`` the ep groups are ``ep_size`` consecutive ranks (DeepSpeed's default); the layer
needs an initialized process group whose size ep_size divides.  The routing rules are in
``sharded_moe``.  What is not built is refused by name: ``use_tutel`` and
``enable_expert_tensor_parallelism`` (no tensor-parallel experts here).  ``deepspeed.initialize`` of a model
with ``ep_size > 1`` reduces the experts' gradients over the expert-data-parallel ranks only
(:func:`expert_parallel`).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from .. import groups
from .sharded_moe import MOELayer, TopKGate

__all__ = ["MoE", "expert_parallel"]

def _ep_group(ep_size: int) -> dist.ProcessGroup | None:
    """This rank's group of ``ep_size`` consecutive ranks, from ``deepspeed.utils.groups`` (made once per
    default process group, DeepSpeed's topology and names)."""
    if ep_size == 1:
        return None
    if not dist.is_initialized() or dist.get_world_size() % ep_size:
        world = dist.get_world_size() if dist.is_initialized() else 1
        raise ValueError(f"ep_size={ep_size}: expert parallelism needs an initialized process group whose size "
                         f"ep_size divides (world size {world}); call deepspeed.init_distributed() first or "
                         f"use ep_size=1")
    groups._create_expert_and_data_parallel(ep_size)
    return groups._get_expert_parallel_group(f"ep_size_{ep_size}")


class MoE(nn.Module):
    """DeepSpeed's MoE layer (see the module docstring)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        for key, on in (("use_tutel", use_tutel), ("enable_expert_tensor_parallelism", enable_expert_tensor_parallelism)):
            if on:
                raise ValueError(f"{key}=True: not built here (no Tutel kernels, no tensor-parallel experts); "
                                 f"leave it False")
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"ep_size={ep_size}: must divide num_experts={num_experts}")
        self.num_experts, self.ep_size, self.k, self.use_residual = num_experts, ep_size, k, use_residual
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        group = _ep_group(ep_size)
        experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(self.num_local_experts))
        for p in experts.parameters():
            p.allreduce, p.group_name = False, self.expert_group_name
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, group, top2_2nd_expert_sampling)
        self.deepspeed_moe = MOELayer(gate, _Experts(experts), self.num_local_experts, ep_size, group)
        if use_residual:
            self.mlp = copy.deepcopy(expert)
            self.coefficient = nn.Linear(hidden_size, 2)

    def forward(self, hidden_states: torch.Tensor,  # type: ignore[override]
                used_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + self.mlp(hidden_states) * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


class _Experts(nn.Module):
    """DeepSpeed's ``Experts``: holds ``deepspeed_experts`` (its parameter names); the layer iterates them."""

    def __init__(self, experts: nn.ModuleList) -> None:
        super().__init__()
        self.deepspeed_experts = experts

    def __iter__(self):
        return iter(self.deepspeed_experts)


def expert_parallel(model: nn.Module) -> tuple[int, list[nn.Module]]:
    """``(ep_size, this rank's expert modules)`` of the model's MoE layers with ``ep_size > 1`` (``(1, [])``
    without any), for ``deepspeed.initialize``: ZeRO reduces those experts over the expert-data-parallel
    ranks only (DeepSpeed's ``_reduce_expert_gradients``), averaged over all dp ranks as DeepSpeed does:
    each layer's experts then pass a ``1/ep_size`` gradient scale (``MOELayer.expert_grad_scale``), since
    our reducers average over the group they reduce in.  One ep_size > 1 per model (DeepSpeed allows
    several groups; not built here)."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.ep_size > 1]
    sizes = sorted({m.ep_size for m in layers})
    if len(sizes) > 1:
        raise ValueError(f"deepspeed.initialize(): MoE layers with ep_size={sizes}: one ep_size > 1 per model is "
                         f"built (its expert groups); give every layer the same ep_size")
    if not layers:
        return 1, []
    for m in layers:
        m.deepspeed_moe.expert_grad_scale = 1.0 / m.ep_size
    return sizes[0], [e for m in layers for e in m.deepspeed_moe.experts.deepspeed_experts]
