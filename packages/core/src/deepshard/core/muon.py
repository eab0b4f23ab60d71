"""Muon on hidden matrices, AdamW on the rest, as one update rule over ZeRO's Shard(0) shards.

Muon (momentum, then Newton-Schulz orthogonalization of the update) is torch's ``torch.optim.Muon``
math: ``buf.lerp_(g, 1 - momentum)``, the nesterov blend, the quintic iteration, the update scaled by
``sqrt(max(1, rows / cols))`` (torch's ``adjust_lr_fn="original"``, DeepSpeed's ``_aspect_ratio_scale``),
decoupled weight decay at the Muon lr.  Which parameters take it is :func:`muon_split`.

**Under ZeRO** every rank holds a Shard(0) row chunk of each matrix; the momentum and the blend are
elementwise and stay on the chunks, but Newton-Schulz needs each whole matrix.  Here each matrix has an
owner (largest first to the least-loaded rank, the same on every rank): one ``all_to_all_single`` sends
every chunk of a matrix to its owner, each owner orthogonalizes the whole matrices it owns, and a second
``all_to_all_single`` returns each rank its rows of the result.  Two collectives per step, each moving one
fp32 copy of the Muon matrices' shards; the orthogonalization work is split across ranks instead of
repeated on each.  3-D expert weights ``[E, out, in]`` get Muon per expert matrix: Shard(0) splits them
by expert, so each rank orthogonalizes its own experts with no communication.

**With the optimizer state offloaded** (``offload.device=cpu``: the host store runs the rule over the
whole parameter list at once, as the device store does) the states and blends are host tensors; the
all-to-alls and Newton-Schulz run on ``device`` (the compute device: nccl takes device tensors only),
and each rank's rows come back to the host for the update.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from deepshard.core.low_precision import StochasticRounder, upcast
from deepshard.core.update_rule import AdamW, UpdateRule
from deepshard.core.zero.layout import shard_rows

__all__ = ["Muon", "muon_split", "zeropower_via_newtonschulz"]

NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's defaults (Keller Jordan's quintic)
NS_EPS = 1e-7
# names that keep AdamW although 2-D: DeepSpeed's split ("embed", "lm_head") plus LoRA's factors (a
# rank-r adapter is tuned with Adam's per-element steps: its B starts at zero and its alpha/r scaling
# assumes them; Muon would push every one of its r directions by the full lr from the first step)
ADAMW_NAMES = ("embed", "lm_head", "lora_")


def muon_split(names: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[bool]:
    """Which parameters Muon updates: 2-D hidden matrices and 3-D stacks of expert matrices.  Embeddings,
    the output head (by name, as DeepSpeed tags them), norms, biases and LoRA factors take AdamW."""
    return [len(s) in (2, 3) and not any(k in n.lower() for k in ADAMW_NAMES) for n, s in zip(names, shapes)]


def zeropower_via_newtonschulz(g: torch.Tensor, *, steps: int, dtype: torch.dtype,
                               coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                               eps: float = NS_EPS) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalization of a matrix (or a batch of them) in ``dtype``, with
    torch.optim.Muon's operations (so bf16 gives its numbers); returned in fp32."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    norm = x.norm() if x.dim() == 2 else x.norm(dim=(-2, -1), keepdim=True)
    x = x / norm.clamp(min=eps)
    mm = torch.addmm if x.dim() == 2 else torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        gram_update = mm(gram, gram, gram, beta=b, alpha=c)
        x = mm(x, gram_update, x, beta=a)
    if tall:
        x = x.mT
    return x.float()


def _owners(numels: list[int], world: int) -> list[int]:
    """An owner rank per matrix: largest first to the least-loaded rank (deterministic on every rank)."""
    load = [0] * world
    owner = [0] * len(numels)
    for k in sorted(range(len(numels)), key=lambda k: (-numels[k], k)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[k] = r
        load[r] += numels[k]
    return owner


@dataclass(frozen=True, eq=False)
class Muon(UpdateRule):
    """Muon for the parameters ``use_muon`` marks, AdamW (``adam``) for the rest.

    ``shapes``: each parameter's global shape; the tensors a store passes are this rank's Shard(0) row
    chunks of them over ``group`` (None: whole tensors, as at stage 0 or world 1).  The schedule's lr
    drives AdamW; Muon takes ``muon_lr * lr / base_lr`` (the same schedule, scaled to its own peak).
    """

    states: ClassVar[tuple[str, ...]] = ("momentum_buffer", "exp_avg", "exp_avg_sq")
    use_muon: tuple[bool, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    group: dist.ProcessGroup | None = None
    adam: AdamW = field(default_factory=AdamW)
    base_lr: float = 1.0
    muon_lr: float = 1.0
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    rounder: StochasticRounder = field(default_factory=StochasticRounder, repr=False)
    device: torch.device | None = None  # where the all-to-alls run (None: where the states are)

    def holds(self, name: str, index: int) -> bool:
        return (name == "momentum_buffer") == self.use_muon[index]

    def update(self, masters: list[torch.Tensor], grads: list[torch.Tensor], states: Mapping[str, list[torch.Tensor]],
               weight_decays: list[float], *, lr: float, step: int, grad_scale: float) -> None:
        assert len(masters) == len(self.use_muon), "Muon updates the whole parameter list at once"
        adam = [i for i, m in enumerate(self.use_muon) if not m]
        self.adam.apply([masters[i] for i in adam], [grads[i] for i in adam],
                        {k: [states[k][i] for i in adam] for k in AdamW.states}, [weight_decays[i] for i in adam],
                        lr=lr, step=step, grad_scale=grad_scale)
        muon = [i for i, m in enumerate(self.use_muon) if m]
        blends = {}
        for i in muon:  # elementwise on the shards: momentum, then the nesterov blend
            g = grads[i].mul_(grad_scale) if grad_scale != 1.0 else grads[i]
            buf = upcast(states["momentum_buffer"][i])
            buf.lerp_(g, 1 - self.momentum)
            blends[i] = g.lerp_(buf, self.momentum) if self.nesterov else buf.clone()
            self.rounder.store(states["momentum_buffer"][i], buf)
        orthogonal = self._orthogonalize(blends)
        muon_lr = self.muon_lr * (lr / self.base_lr)
        for i in muon:
            rows, cols = self.shapes[i][-2:]
            m32 = upcast(masters[i])
            m32.mul_(1 - muon_lr * weight_decays[i])
            m32.add_(orthogonal[i].to(m32.device), alpha=-muon_lr * math.sqrt(max(1.0, rows / cols)))
            self.rounder.store(masters[i], m32)

    def _ns(self, x: torch.Tensor) -> torch.Tensor:
        return zeropower_via_newtonschulz(x, steps=self.ns_steps, dtype=self.ns_dtype)

    def _orthogonalize(self, blends: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each parameter's rows of the orthogonalized whole matrix (see the module docstring)."""
        world = 1 if self.group is None else dist.get_world_size(self.group)
        out = {i: self._ns(b) for i, b in blends.items() if world == 1 or len(self.shapes[i]) == 3}
        whole = [i for i in blends if i not in out]  # 2-D matrices split across the group's ranks
        if not whole:
            return out
        rank = dist.get_rank(self.group)
        owner = dict(zip(whole, _owners([math.prod(self.shapes[i]) for i in whole], world)))
        cols = {i: self.shapes[i][1] for i in whole}

        def chunk(i: int, r: int) -> int:  # elements of rank r's row chunk of matrix i
            lo, hi = shard_rows(self.shapes[i][0], world, r)
            return (hi - lo) * cols[i]

        mine = [i for i in whole if owner[i] == rank]
        device = self.device or blends[whole[0]].device  # host states (offload): sent from the compute device
        send = torch.cat([blends[i].reshape(-1) for r in range(world) for i in whole if owner[i] == r]).to(device)
        recv = torch.empty(sum(chunk(i, r) for r in range(world) for i in mine), device=device)
        dist.all_to_all_single(recv, send, [sum(chunk(i, rank) for i in whole if owner[i] == r) for r in range(world)],
                               [sum(chunk(i, r) for i in mine) for r in range(world)], group=self.group)
        pieces = {i: [] for i in mine}
        offset = 0
        for r in range(world):  # rank r sent its chunks of my matrices, in my matrices' order
            for i in mine:
                pieces[i].append(recv[offset:offset + chunk(i, r)])
                offset += chunk(i, r)
        done = {i: self._ns(torch.cat(pieces[i]).view(self.shapes[i])).reshape(-1) for i in mine}
        back = torch.cat([done[i][sum(chunk(i, q) for q in range(r)):][:chunk(i, r)]
                          for r in range(world) for i in mine]) if mine else torch.empty(0, device=device)
        ours = torch.empty(sum(chunk(i, rank) for i in whole), device=device)
        dist.all_to_all_single(ours, back, [sum(chunk(i, r) for i in mine) for r in range(world)],
                               [sum(chunk(i, rank) for i in whole if owner[i] == r) for r in range(world)],
                               group=self.group)
        offset = 0
        for r in range(world):
            for i in whole:
                if owner[i] == r:
                    out[i] = ours[offset:offset + chunk(i, rank)].view(blends[i].shape)
                    offset += chunk(i, rank)
        return out
