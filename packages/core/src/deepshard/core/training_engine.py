"""What a training loop, its checkpoints and its logs need from a training engine, as one small Protocol.

``deepshard.core.initialize``'s :class:`~deepshard.core.engine.Engine` and ``deepshard.pipeline``'s
``PipelineEngine`` are both training engines, so the app's checkpointing and logging take either.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deepshard.core.memory import ModelStateBytes
from deepshard.core.optim import ZeroOptimizer

__all__ = ["TrainingEngine"]


@runtime_checkable
class TrainingEngine(Protocol):
    mesh: DeviceMesh  # the (pp, dp, tp) mesh
    optimizer: ZeroOptimizer  # the ZeRO stage, the state store, the schedule and the loss scaler
    num_params: int  # Ψ of the memory formulas: this rank's parameters before dp sharding

    @property
    def modules(self) -> list[nn.Module]:
        """The modules this rank computes: the whole model, or its pipeline stages."""

    @property
    def model(self) -> nn.Module | None:
        """The whole model where this rank computes all of it (eval, sampling, frozen params in
        checkpoints); None for pipeline stages."""

    def memory(self) -> dict[str, ModelStateBytes]:
        """Measured and expected per-rank model-state bytes."""
