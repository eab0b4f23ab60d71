"""One ZeRO stage over parameters sharded in different groups: MoE experts under expert parallelism.

With ``parallel.ep`` each rank holds only its experts, so their ZeRO group is the dp ranks left after
ep (``edp``), not dp: stages 0-2 then run one bucketed stage per group and :class:`SplitStage` shows
the optimizer glue the two as one (their tensors concatenated, dense first).  Replication stays per
part: an expert shard is held by no other rank of the world at stages 1-2, and by the ``edp`` ranks
at stage 0, which is what each part's own ``replication()`` says of its group.
"""

from __future__ import annotations

import torch
from torch import nn

from deepshard.core.config import ZeroConfig
from deepshard.core.zero.handoff import GradHandoff
from deepshard.core.zero.stages import ZeroStage


def check_experts(config: ZeroConfig, *, dtype: str = "fp32", hsdp: bool = False, offload_params: bool = False) -> None:
    """Refuse, before start, what expert-parallel sharding is not built with (ValueError naming the key)."""
    if config.stage != 3 and dtype != "fp32":
        raise ValueError(f"precision.dtype={dtype} with parallel.ep > 1 needs zero.stage=3 (got zero.stage="
                         f"{config.stage}): the fp32 masters of experts sharded over their own group are built "
                         f"for FSDP2 only; use zero.stage=3 or precision.dtype=fp32")
    refused = (("zero.quantized_weights", config.quantized_weights, "ZeRO++'s qwZ all-gather"),
               ("zero.quantized_gradients", config.quantized_gradients, "ZeRO++'s qgZ reduce-scatter"),
               ("parallel.dp_replicate", hsdp, "HSDP"),
               ("offload.params", offload_params, "parameter offload"))
    for key, on, what in refused:
        if on:
            raise ValueError(f"{key} with parallel.ep > 1: {what} is not built for experts sharded over their own "
                             f"group; turn {key} off or use parallel.ep=1")


class SplitStage(ZeroStage):
    """Several stages of one ZeRO level over disjoint parameter sets, seen as one (their lists joined)."""

    def __init__(self, parts: list[ZeroStage]) -> None:
        assert parts and len({p.zero_stage for p in parts}) == 1, "one ZeRO level for every part"
        self.parts = parts
        self.expert_parallel = True
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
