"""A sparse Mixture-of-Experts block, family-free: a router, top-k routing, dropless experts.

Routing (``routing=``): ``"softmax_topk"`` (Qwen3-MoE, Qwen2-MoE, OLMoE: softmax over every expert,
then the top k, their weights renormalized to sum 1 when ``norm_topk_prob``) and ``"topk_softmax"``
(Mixtral: the top k logits, softmax over those k).  Every token goes to its k experts (dropless).

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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from deepshard.core.step import add_aux_loss
from deepshard.finetune.models.moe_ep import ScaleGrad, dispatch_and_run

ROUTINGS = ("softmax_topk", "topk_softmax")
IMPLS = ("grouped", "loop")


@dataclass
class RouterStats:
    """What the MoE layers of one model share in a forward: the token mask, each layer's statistics
    and the aux loss of the last forward (for logging and tests).  The last MoE layer computes the
    aux over all of them and attaches it; entries are overwritten by the next forward (an activation
    checkpoint's recompute finds the same values)."""

    coef: float = 0.0
    last_layer: int = -1
    mask: torch.Tensor | None = None  # [tokens] float, 1 = counts; None: every position
    entries: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    aux: torch.Tensor | None = None
    routes: dict[int, torch.Tensor] | None = None  # a dict: each layer's expert ids [tokens, k] kept (tests)


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


class SparseMoe(nn.Module):
    """Router (``gate``: a linear to ``num_experts`` logits) + top-k routing + dropless experts, in
    place of a dense MLP on [batch, seq, dim]."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, routing: str,
                 norm_topk_prob: bool = True, impl: str = "grouped", layer_id: int = 0,
                 stats: RouterStats | None = None) -> None:
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"routing={routing!r}: valid values are {list(ROUTINGS)}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k}: must be in 1..num_experts={num_experts}")
        self.num_experts, self.top_k, self.routing, self.norm_topk_prob = num_experts, top_k, routing, norm_topk_prob
        self.layer_id = layer_id
        self.stats = stats if stats is not None else RouterStats(last_layer=layer_id)
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, hidden, impl)
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
        order = idx.reshape(-1).argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(idx.reshape(-1), minlength=self.num_experts)
        token = order // self.top_k
        if self.ep_group is None:
            out = self.experts(flat[token], counts)
        else:  # to the experts' ranks and back (all-to-all)
            out = dispatch_and_run(self.experts, flat[token], counts, self.ep_group)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        y = torch.zeros_like(flat).index_add_(0, token, out.to(flat.dtype)).reshape(shape)
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
        if self.layer_id != s.last_layer:
            return y
        entries = [s.entries[k] for k in sorted(s.entries)]
        rows = sum(e[2] for e in entries)
        c = sum(e[0] for e in entries) / rows
        p = sum(e[1] for e in entries) / rows
        aux = self.num_experts * (c * p).sum()
        s.aux = aux.detach()
        return add_aux_loss(y, aux, weight=s.coef) if s.coef else y
