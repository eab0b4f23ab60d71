"""``deepspeed.moe.sharded_moe``: DeepSpeed's GShard-style gate and capacity-buffer MoE layer, written here
from its documented semantics (DeepSpeed 0.19.8), so a script built on ``deepspeed.moe.layer.MoE`` trains
the same way.

- **Capacity** (``_capacity``): ``max(ceil(tokens / experts * factor), min_capacity)`` with ``factor``
  ``capacity_factor`` (training) or ``eval_capacity_factor``, times k for k >= 2.  ``drop_tokens=False``:
  the capacity is the busiest expert's count (its max over the ep group), nothing is dropped.
- **Top-1**: argmax of the softmax (of the Gumbel-noised logits under ``noisy_gate_policy='RSample'``);
  over capacity, ``use_rts`` keeps a uniformly random subset of an expert's tokens, else its first ones
  (DeepSpeed takes a topk over equal priorities there, whose tie order the kernel decides).
  ``l_aux = E * sum_e mean(gates_e) * mean(mask_e)``.
- **Top-2**: the second expert is the argmax of the logits without the first (Gumbel-noised when
  ``top2_2nd_expert_sampling``); second choices queue after every first choice; the two kept gates are
  renormalized to sum 1.  ``l_aux = E^2 * mean_e(mean(gates_e) * mean(mask1_e))``.
- **Top-k (k > 2)**: the top k of the softmax; over capacity, each expert keeps its highest-gate tokens
  (``drop_policy='probs'``); kept gates renormalized.  ``l_aux = E^2 / k * mean_e(me_e * ce_e)``.
- ``exp_counts``: tokens per expert before dropping.

The layer moves a ``[experts, capacity, hidden]`` buffer: with ``ep_size > 1`` one equal-split
all-to-all over the ep group (``ep_size`` consecutive ranks, DeepSpeed's default grouping) each way.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["MOELayer", "TopKGate", "top1gating", "top2gating", "topkgating"]


def _capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    return max(math.ceil(tokens / experts * factor), min_capacity)


def _gumbel(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) noise drawn as DeepSpeed's ``gumbel_rsample`` draws it (the same RNG draws, bit for bit)."""
    one, zero = torch.tensor(1.0, device=device), torch.tensor(0.0, device=device)
    return torch.distributions.gumbel.Gumbel(zero, one).rsample(shape)


def _dropless_capacity(counts: torch.Tensor, ep_group: dist.ProcessGroup | None) -> int:
    top = counts.max().clone()
    if ep_group is not None and dist.get_world_size(ep_group) > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ep_group)
    return int(top)


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """[S, E] 0/1 -> each token's slot in its expert's buffer (token order)."""
    return torch.cumsum(mask, dim=0) - 1


def _combine(gates: torch.Tensor, mask: torch.Tensor, locations: torch.Tensor, capacity: int) -> torch.Tensor:
    """[S, E] gates, 0/1 kept mask and buffer slots -> combine weights [S, E, capacity]."""
    slot = F.one_hot((locations * mask).long(), max(capacity, 1))[..., :capacity].to(gates.dtype)
    return (gates * mask)[..., None] * slot


def top1gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, *,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: dist.ProcessGroup | None = None, used_token: torch.Tensor | None = None):
    """(l_aux, combine_weights [S, E, C], dispatch_mask [S, E, C], exp_counts [E])."""
    gates = torch.softmax(logits, dim=1)
    chooser = logits + _gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    experts = gates.shape[1]
    mask = F.one_hot(chooser.argmax(dim=1), experts)
    if used_token is not None:
        mask = mask * used_token[:, None].to(mask.dtype)
    counts = mask.sum(dim=0).detach()
    capacity = (_capacity(gates.shape[0], experts, capacity_factor, min_capacity) if drop_tokens
                else min(_dropless_capacity(counts, ep_group), gates.shape[0]))
    l_aux = (gates.mean(dim=0) * mask.float().mean(dim=0)).sum() * experts
    if use_rts:  # a uniformly random subset of each expert's tokens
        priority = mask * torch.rand(mask.shape, device=mask.device)
        mask = mask * torch.zeros_like(mask).scatter_(0, torch.topk(priority, min(capacity, mask.shape[0]), dim=0)[1], 1)
    else:  # its first tokens (DeepSpeed's topk over equal priorities leaves the order to the kernel)
        mask = mask * (_positions(mask) < capacity)
    combine = _combine(gates, mask, _positions(mask), capacity)
    return l_aux, combine, combine.bool(), counts


def top2gating(logits: torch.Tensor, capacity_factor: float, min_capacity: int, *, drop_tokens: bool = True,
               ep_group: dist.ProcessGroup | None = None, top2_2nd_expert_sampling: bool = True):
    """(l_aux, combine_weights, dispatch_mask, exp_counts) of DeepSpeed's top-2 gate."""
    gates = torch.softmax(logits, dim=1)
    experts = gates.shape[1]
    mask1 = F.one_hot(gates.argmax(dim=1), experts)
    second = logits + _gumbel(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    mask2 = F.one_hot(second.masked_fill(mask1.bool(), float("-inf")).argmax(dim=1), experts)
    loc1, loc2 = _positions(mask1), _positions(mask2) + mask1.sum(dim=0, keepdim=True)
    l_aux = (gates.mean(dim=0) * mask1.float().mean(dim=0)).mean() * experts * experts
    counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = _capacity(gates.shape[0], experts, capacity_factor * 2, min_capacity)
        mask1, mask2 = mask1 * (loc1 < capacity), mask2 * (loc2 < capacity)
    else:
        capacity = _dropless_capacity(counts, ep_group)
    g1, g2 = (gates * mask1).sum(dim=1), (gates * mask2).sum(dim=1)
    denom = (g1 + g2).clamp(min=torch.finfo(gates.dtype).eps)
    combine = (_combine((g1 / denom)[:, None].expand_as(gates), mask1, loc1, capacity)
               + _combine((g2 / denom)[:, None].expand_as(gates), mask2, loc2, capacity))
    return l_aux, combine, combine.bool(), counts


def topkgating(logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, *, drop_tokens: bool = True,
               ep_group: dist.ProcessGroup | None = None):
    """(l_aux, combine_weights, dispatch_mask, exp_counts) of DeepSpeed's top-k gate (drop_policy='probs')."""
    gates = torch.softmax(logits, dim=1)
    experts = gates.shape[1]
    top, idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates).scatter_(1, idx, 1.0)
    counts = mask.sum(dim=0).detach().long()
    l_aux = (gates.mean(dim=0) * mask.mean(dim=0)).mean() * experts * experts / k
    if drop_tokens:
        capacity = _capacity(gates.shape[0], experts, capacity_factor * k, min_capacity)
        scored = torch.zeros_like(gates).scatter(1, idx, top)
        best = torch.topk(scored, k=min(capacity, gates.shape[0]), dim=0)[1]
        mask = mask * torch.zeros_like(mask).scatter_(0, best, 1.0)
    else:
        capacity = _dropless_capacity(counts, ep_group)
    kept = gates * mask
    kept = kept / kept.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
    combine = _combine(kept, mask, _positions(mask), capacity)
    return l_aux, combine, combine.bool(), counts


class TopKGate(nn.Module):
    """DeepSpeed's gate: ``wg`` (a bias-free linear to the experts' logits, run in fp32) and the rule above."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: dist.ProcessGroup | None = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if noisy_gate_policy not in (None, "None", "Jitter", "RSample"):
            raise ValueError(f"noisy_gate_policy={noisy_gate_policy!r}: valid values are None, 'Jitter', 'RSample'")
        if not 1 <= k <= num_experts:
            raise ValueError(f"k={k}: must be in 1..num_experts={num_experts}")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.capacity_factor, self.eval_capacity_factor = k, capacity_factor, eval_capacity_factor
        self.min_capacity, self.drop_tokens, self.use_rts = min_capacity, drop_tokens, use_rts
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.ep_group, self.top2_2nd_expert_sampling = ep_group, top2_2nd_expert_sampling

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None):  # type: ignore[override]
        x = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
        logits = F.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, factor, self.min_capacity, used_token=used_token, use_rts=self.use_rts,
                              noisy_gate_policy=self.noisy_gate_policy if self.training else None,
                              drop_tokens=self.drop_tokens, ep_group=self.ep_group)
        if self.k == 2:
            return top2gating(logits, factor, self.min_capacity, drop_tokens=self.drop_tokens, ep_group=self.ep_group,
                              top2_2nd_expert_sampling=self.top2_2nd_expert_sampling)
        return topkgating(logits, self.k, factor, self.min_capacity, drop_tokens=self.drop_tokens,
                          ep_group=self.ep_group)


class _AllToAll(torch.autograd.Function):
    """Equal-split ``all_to_all_single`` over the ep group, reversed in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = torch.empty_like(x.contiguous())
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _AllToAll.apply(grad, ctx.group), None


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; the gradient times ``scale`` in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad * ctx.scale, None


class MOELayer(nn.Module):
    """Gate -> ``[experts, capacity, hidden]`` buffer -> (all-to-all) -> local experts -> back -> combine."""

    def __init__(self, gate: TopKGate, experts: nn.ModuleList, num_local_experts: int, ep_size: int,
                 ep_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.num_local_experts, self.ep_size, self.ep_group = num_local_experts, ep_size, ep_group
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None
        # the experts' weight-gradient factor (moe.layer.expert_parallel sets 1/ep under deepspeed.initialize):
        # the experts' output gradient is scaled by it and their input gradient by its inverse, so only the
        # experts' own parameters see it, whatever module the expert is (FSDP2 units included)
        self.expert_grad_scale = 1.0

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        d_model = x.shape[-1]
        tokens = x.reshape(-1, d_model)
        self.l_aux, combine, dispatch, self.exp_counts = self.gate(tokens, used_token)
        buffer = torch.einsum("sec,sm->ecm", dispatch.to(x.dtype), tokens)
        if self.ep_size > 1:
            buffer = _AllToAll.apply(buffer, self.ep_group)
        buffer = buffer.reshape(self.ep_size, self.num_local_experts, -1, d_model)
        scale = self.expert_grad_scale
        if scale != 1.0:
            buffer = _ScaleGrad.apply(buffer, 1.0 / scale)
        out = torch.cat([expert(chunk) for expert, chunk in zip(self.experts, buffer.chunk(self.num_local_experts,
                                                                                            dim=1), strict=True)], dim=1)
        if scale != 1.0:
            out = _ScaleGrad.apply(out, scale)
        if self.ep_size > 1:
            out = _AllToAll.apply(out, self.ep_group)
        out = out.reshape(self.ep_size * self.num_local_experts, -1, d_model)
        return torch.einsum("sec,ecm->sm", combine.to(x.dtype), out).reshape(x.shape)
