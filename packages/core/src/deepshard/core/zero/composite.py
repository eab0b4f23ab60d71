"""Several ZeRO stages seen as one by the optimizer: their parameter lists joined, in order.

Two users: MoE experts under expert parallelism (a dense part over dp and an expert part over ``edp``,
``deepshard.core.zero.split``) and the virtual pipeline stages of one rank (``deepshard.pipeline``).
Replication stays per part: each part's own ``replication()`` speaks of its group.
"""

from __future__ import annotations

import torch
from torch import nn

from deepshard.core.zero.handoff import GradHandoff
from deepshard.core.zero.stages import ZeroStage

__all__ = ["CompositeStage"]


class CompositeStage(ZeroStage):
    """Several stages of one ZeRO level over disjoint parameter sets, seen as one (their lists joined)."""

    def __init__(self, parts: list[ZeroStage]) -> None:
        assert parts and len({p.zero_stage for p in parts}) == 1, "one ZeRO level for every part"
        self.parts = parts
        self.expert_parallel = any(p.expert_parallel for p in parts)
        self.zero_stage = parts[0].zero_stage
        self.names = [n for p in parts for n in p.names]
        self.params: list[nn.Parameter] = [q for p in parts for q in p.params]

    def local_params(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.local_params()]

    def local_grads(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.local_grads()]

    def replication(self) -> list[int]:
        return [r for p in self.parts for r in p.replication()]

    def grad_handoffs(self) -> list[tuple[GradHandoff, int]]:
        out, offset = [], 0
        for part in self.parts:
            out += [(handoff, offset + o) for handoff, o in part.grad_handoffs()]
            offset += len(part.params)
        return out

    def set_grad_sync(self, enabled: bool) -> None:
        for p in self.parts:
            p.set_grad_sync(enabled)

    def finish_backward(self) -> None:
        for p in self.parts:
            p.finish_backward()

    def after_step(self) -> None:
        for p in self.parts:
            p.after_step()

    def gather_params(self) -> None:
        for p in self.parts:
            p.gather_params()

    def zero_grad(self) -> None:
        for p in self.parts:
            p.zero_grad()

    def grad_bytes(self) -> int:
        return sum(p.grad_bytes() for p in self.parts)

    def buffer_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for part in self.parts:
            for k, v in part.buffer_bytes().items():
                out[k] = out.get(k, 0) + v
        return out

    def param_bytes(self) -> int:
        return sum(p.param_bytes() for p in self.parts)
