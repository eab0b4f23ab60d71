"""DeepSpeed's engine queries, answered once for both of our engines.

DeepSpeed's ``PipelineEngine`` is a subclass of its ``DeepSpeedEngine``, so scripts ask either one
the same questions (``fp16_enabled()``, ``zero_optimization_stage()``, ``get_lr()``...).  Ours are two
classes over different training engines (core's engine, the pipeline engine); both answer from the
translated config and the ZeRO optimizer through this base.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from deepshard.core.mesh import local_device
from deepshard.core.optim import StepStats

from .config import CompatConfig


class ModuleAttributes:
    """Attributes an engine lacks come from its ``module``, as in DeepSpeed.  Listed before ``nn.Module``
    in an engine's bases, so that the module's own parameters, buffers and submodules are found first."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            pass
        module = self._modules.get("module")  # type: ignore[attr-defined]
        if module is not None and name != "module":
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


class RankQueries:
    """Where this process computes and which rank it is: every engine of ours answers these alike
    (the training ones, and the forward-only one ``initialize`` returns without an optimizer)."""

    @property
    def device(self) -> torch.device:
        return local_device()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def global_rank(self) -> int:
        return torch.distributed.get_rank()


class DeepSpeedQueries(RankQueries):
    """Config and state queries; a subclass sets ``compat``, ``config`` (the ds_config dict),
    ``optimizer`` (the ZeroOptimizer) and ``last_stats`` (the last update's, None before one)."""

    compat: CompatConfig
    config: dict
    optimizer: Any
    last_stats: StepStats | None

    # --- batch arithmetic
    def train_batch_size(self) -> int:
        return self.compat.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.compat.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.compat.grad_accum

    def get_lr(self) -> list[float]:
        """The rate of the next update, one per parameter group (we have one)."""
        opt = self.optimizer
        return [opt.lr_at(opt.num_updates)]

    # --- the config
    def fp16_enabled(self) -> bool:
        """Whether the model computes in fp16 (an fp16 ds_config on a CPU host trains in fp32: False)."""
        return self.compat.engine.precision.dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.compat.engine.precision.dtype == "bf16"

    def bf16_enabled(self) -> bool:
        return self.bfloat16_enabled()

    def zero_optimization_stage(self) -> int:
        return self.compat.engine.zero.stage

    def zero_optimization(self) -> bool:
        return self.compat.engine.zero.stage > 0

    def gradient_clipping(self) -> float:
        return self.compat.engine.optim.grad_clip

    def steps_per_print(self) -> int:
        return int(self.config.get("steps_per_print", 10))

    # --- state
    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last update (before clipping, loss scale removed); None before one."""
        stats = self.last_stats
        return None if stats is None else stats.grad_norm

    @property
    def loss_scale(self) -> float:
        return float(self.optimizer.scaler.scale)
