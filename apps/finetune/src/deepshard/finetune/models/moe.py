"""A sparse Mixture-of-Experts block, family-free: a router, top-k routing, dropless experts.

Routing (``routing=``): ``"softmax_topk"`` (Qwen3-MoE, Qwen2-MoE, OLMoE: softmax over every expert,
then the top k, their weights renormalized to sum 1 when ``norm_topk_prob``) and ``"topk_softmax"``
(Mixtral: the top k logits, softmax over those k).  Every token goes to its k experts (dropless) unless
a :class:`CapacityConfig` with ``drop_tokens`` caps each expert at DeepSpeed's capacity,
``max(ceil(tokens / num_experts * capacity_factor * k), min_capacity)`` per layer and micro-batch on
this rank (``eval_capacity_factor`` in eval mode; DeepSpeed's ``_capacity`` with its top-k factor
``capacity_factor * k``).  Which (token, slot) pairs go over: positions in slot-major order, every
token's first choice before any second choice, then token order (DeepSpeed's ``top2gating`` / GShard;
top-1 is DeepSpeed's ``top1gating`` without random token selection).  A dropped pair contributes
nothing to its token's output (the residual carries the token); the kept pairs' weights are not
renormalized (Megatron's rule).  Dropping happens before dispatch, so under expert parallelism the
all-to-all carries only the kept rows.  The load-balancing statistics count the routing before
dropping, as DeepSpeed's do.

Qwen2-MoE's shared expert (``shared_hidden`` > 0): a dense SwiGLU every token runs besides its routed
experts, scaled by ``sigmoid(shared_expert_gate(x))``, added to the routed output (transformers'
``Qwen2MoeSparseMoeBlock``; names ``shared_expert.{gate,up,down}_proj``, ``shared_expert_gate``).

The optional router z-loss (ST-MoE): per sparse layer ``mean over counted tokens of
logsumexp(logits)^2``, summed over the layers, times ``router_z_loss_coef``, added to the step's loss
like the aux loss (below).

Experts are stacked 3-D weights in transformers 5's layout, ``gate_up_proj`` [E, 2I, H] (gate rows
first) and ``down_proj`` [E, H, I], so an exported name is transformers' own.  They run as ONE grouped
GEMM per projection over the tokens sorted by expert (``torch._grouped_mm``, forward and backward, on
CPU too); ``impl="loop"`` is the plain per-expert reference.  ``_grouped_mm`` needs 16-byte-aligned
strides, so odd sizes are zero-padded up to the alignment (the pad rows/columns contribute zeros), and
its backward rejects a stride-0 gradient, so the gradient reaching it is made contiguous.

The load-balancing loss (Switch / Mixtral, transformers' ``load_balancing_loss_func``) is computed over
every MoE layer of one forward jointly, exactly as transformers does: with ``c`` the top-k assignment
counts and ``p`` the softmax probabilities summed over the layers' tokens, and ``R`` the rows counted
(tokens x layers), ``aux = E * sum_e (c_e / R) * (p_e / R)``.  Which tokens count: every position,
unless the model's forward gets an ``attention_mask`` (1 = real token), when only those; this is
transformers' own rule with and without a mask (the app passes none: padding counts, as in transformers
called without a mask).  The statistics are this rank's and this micro-batch's (as DeepSpeed's and
Megatron's): under dp or accumulation the step adds ``coef * mean over micro-batches`` of the aux
(``deepshard.core.step.add_aux_loss``), which is not the aux of the pooled global batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from deepshard.core.step import add_aux_loss
from deepshard.finetune.models.moe_ep import ScaleGrad, dispatch_and_run

ROUTINGS = ("softmax_topk", "topk_softmax")
IMPLS = ("grouped", "loop")


@dataclass(frozen=True)
class CapacityConfig:
    """DeepSpeed's token-dropping knobs (its MoE layer's defaults except ``drop_tokens``: dropless here)."""

    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    drop_tokens: bool = False

    def __post_init__(self) -> None:
        for key in ("capacity_factor", "eval_capacity_factor"):
            if not getattr(self, key) > 0:
                raise ValueError(f"model.{key}={getattr(self, key)}: must be > 0")
        if self.min_capacity < 0:
            raise ValueError(f"model.min_capacity={self.min_capacity}: must be >= 0")

    def capacity(self, tokens: int, num_experts: int, top_k: int, *, training: bool) -> int:
        """DeepSpeed's ``_capacity`` with its top-k factor: rows each expert takes from ``tokens`` tokens."""
        factor = self.capacity_factor if training else self.eval_capacity_factor
        return max(math.ceil(tokens / num_experts * factor * top_k), self.min_capacity)


def capacity_keep(idx: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """[T, k] bool: the (token, slot) pairs of expert ids ``idx`` [T, k] within each expert's
    ``capacity``, filled in slot-major order (every first choice, in token order, before any second)."""
    t, k = idx.shape
    slot_major = idx.t().reshape(-1)
    onehot = F.one_hot(slot_major, num_experts)
    position = (onehot.cumsum(0) - 1).gather(1, slot_major[:, None])[:, 0]
    return (position < capacity).reshape(k, t).t()


@dataclass
class RouterStats:
    """What the MoE layers of one model share in a forward: the token mask, each layer's statistics
    and the aux loss of the last forward (for logging and tests).  The last MoE layer computes the
    aux over all of them and attaches it; entries are overwritten by the next forward (an activation
    checkpoint's recompute finds the same values)."""

    coef: float = 0.0
    z_coef: float = 0.0  # router_z_loss_coef: ST-MoE's z-loss (0: not computed)
    last_layer: int = -1
    mask: torch.Tensor | None = None  # [tokens] float, 1 = counts; None: every position
    entries: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    aux: torch.Tensor | None = None
    routes: dict[int, torch.Tensor] | None = None  # a dict: each layer's expert ids [tokens, k] kept (tests)
    dropped: dict[int, int] = field(default_factory=dict)  # per layer: (token, slot) pairs over capacity
    z_losses: dict[int, torch.Tensor] = field(default_factory=dict)  # per layer, detached

    def scalars(self) -> dict[str, float]:
        """The last forward's figures (this rank's last micro-batch) for the run's metrics."""
        out = {"moe/dropped_tokens": float(sum(self.dropped.values()))}
        if self.aux is not None:
            out["moe/aux_loss"] = self.aux.item()
        if self.z_losses:
            out["moe/z_loss"] = float(sum(z.item() for z in self.z_losses.values()))
        return out


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (``_grouped_mm``'s backward rejects stride 0)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad.contiguous()


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    return F.pad(t, pad)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x`` [T, K] sorted by group, ``weight`` [G, N, K] (nn.Linear's orientation per group), ``offs``
    [G] int32 cumulative row ends: rows of group g times ``weight[g].T``, one grouped GEMM -> [T, N]."""
    n = weight.shape[1]
    align = max(1, 16 // x.element_size())
    xa = _pad_to(x, 1, align).contiguous()
    wa = _pad_to(_pad_to(weight, 2, align), 1, align)
    out = torch._grouped_mm(xa, wa.transpose(1, 2), offs=offs)
    return _ContiguousGrad.apply(out)[:, :n]


class Experts(nn.Module):
    """``num_experts`` SwiGLU FFNs as stacked weights; ``forward(x_sorted, counts)`` runs each expert
    on its contiguous run of rows (``counts[e]`` rows, in expert order)."""

    def __init__(self, num_experts: int, dim: int, hidden: int, impl: str = "grouped",
                 device: torch.device | None = None) -> None:
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r}: valid values are {list(IMPLS)}")
        self.num_experts, self.hidden, self.impl = num_experts, hidden, impl
        # expert parallelism (models/moe_ep.py): this module holds experts first .. first + num_local - 1
        self.first, self.num_local, self.grad_scale = 0, num_experts, 1.0
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim, device=device))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden, device=device))

    def shard(self, rank: int, ep: int) -> None:
        """Keep only expert group ``rank`` of ``ep`` (its weights' gradient scaled ``1/ep``: models/moe_ep.py)."""
        assert self.num_local == self.num_experts and self.num_experts % ep == 0
        self.num_local = self.num_experts // ep
        self.first, self.grad_scale = rank * self.num_local, 1.0 / ep
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(self, name)
            part = whole.detach()[self.first:self.first + self.num_local].clone()
            setattr(self, name, nn.Parameter(part, requires_grad=whole.requires_grad))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w_in, w_out = self.gate_up_proj, self.down_proj
        if self.grad_scale != 1.0:
            w_in, w_out = ScaleGrad.apply(w_in, self.grad_scale), ScaleGrad.apply(w_out, self.grad_scale)
        if self.impl == "grouped":
            offs = counts.cumsum(0).to(torch.int32)
            gate, up = grouped_linear(x, w_in, offs).chunk(2, dim=-1)
            return grouped_linear(F.silu(gate) * up, w_out, offs)
        outs, start = [], 0
        for e, n in enumerate(counts.tolist()):  # the reference: one expert at a time
            gate, up = F.linear(x[start:start + n], w_in[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w_out[e]))
            start += n
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


class SharedExpert(nn.Module):
    """The dense SwiGLU every token also runs (Qwen2-MoE's ``shared_expert``)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Router (``gate``: a linear to ``num_experts`` logits) + top-k routing + dropless experts, in
    place of a dense MLP on [batch, seq, dim]."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, routing: str,
                 norm_topk_prob: bool = True, impl: str = "grouped", layer_id: int = 0,
                 stats: RouterStats | None = None, capacity: CapacityConfig | None = None,
                 shared_hidden: int = 0) -> None:
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"routing={routing!r}: valid values are {list(ROUTINGS)}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k}: must be in 1..num_experts={num_experts}")
        self.num_experts, self.top_k, self.routing, self.norm_topk_prob = num_experts, top_k, routing, norm_topk_prob
        self.layer_id, self.capacity = layer_id, capacity or CapacityConfig()
        self.stats = stats if stats is not None else RouterStats(last_layer=layer_id)
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, hidden, impl)
        if shared_hidden:  # Qwen2-MoE
            self.shared_expert = SharedExpert(dim, shared_hidden)
            self.shared_expert_gate = nn.Linear(dim, 1, bias=False)
        self.ep_group: object | None = None  # the ep ranks' group under expert parallelism (models/moe_ep.py)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k]) of router ``logits`` [T, E]."""
        if self.routing == "topk_softmax":
            top, idx = torch.topk(logits.float(), self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), idx
        probs = torch.softmax(logits.float(), dim=-1)
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.gate(flat)
        weights, idx = self.route(logits)
        if self.stats.routes is not None:
            self.stats.routes[self.layer_id] = idx.detach()
        flat_idx, rows = idx.reshape(-1), idx.numel()
        if self.capacity.drop_tokens:  # pairs over capacity get the sentinel expert E and are cut off
            cap = self.capacity.capacity(flat.shape[0], self.num_experts, self.top_k, training=self.training)
            flat_idx = flat_idx.masked_fill(~capacity_keep(idx, self.num_experts, cap).reshape(-1), self.num_experts)
            rows = int((flat_idx < self.num_experts).sum())
        self.stats.dropped[self.layer_id] = idx.numel() - rows
        order = flat_idx.argsort(stable=True)[:rows]  # kept (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_idx, minlength=self.num_experts + 1)[:self.num_experts]
        token = order // self.top_k
        if self.ep_group is None:
            out = self.experts(flat[token], counts)
        else:  # to the experts' ranks and back (all-to-all)
            out = dispatch_and_run(self.experts, flat[token], counts, self.ep_group)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        y = torch.zeros_like(flat).index_add_(0, token, out.to(flat.dtype))
        if hasattr(self, "shared_expert"):
            y = y + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        y = y.reshape(shape)
        return self._balance(y, logits, idx)

    def _balance(self, y: torch.Tensor, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Record this layer's statistics; the last MoE layer attaches the joint aux loss to its output."""
        s = self.stats
        probs = torch.softmax(logits.float(), dim=-1)
        mask = s.mask if s.mask is not None else probs.new_ones(probs.shape[0])
        with torch.no_grad():
            counts = torch.zeros(self.num_experts, device=probs.device).scatter_add_(
                0, idx.reshape(-1), mask.repeat_interleave(self.top_k))
        s.entries[self.layer_id] = (counts, (probs * mask[:, None]).sum(0), mask.sum())
        if s.z_coef:  # ST-MoE's router z-loss of this layer, over the counted tokens
            z = (torch.logsumexp(logits.float(), dim=-1).square() * mask).sum() / mask.sum().clamp(min=1)
            s.z_losses[self.layer_id] = z.detach()
            y = add_aux_loss(y, z, weight=s.z_coef)
        if self.layer_id != s.last_layer:
            return y
        entries = [s.entries[k] for k in sorted(s.entries)]
        rows = sum(e[2] for e in entries)
        c = sum(e[0] for e in entries) / rows
        p = sum(e[1] for e in entries) / rows
        aux = self.num_experts * (c * p).sum()
        s.aux = aux.detach()
        return add_aux_loss(y, aux, weight=s.coef) if s.coef else y
