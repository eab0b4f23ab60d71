"""Per-rank model-state bytes: the ZeRO paper's expectation beside what the live tensors hold.

Bytes per parameter (Ψ = this rank's parameter count before data-parallel sharding, N = dp size):

| stage | fp32 training           | bf16/fp16 (fp32 master, fp32 gradient accumulation) |
|-------|-------------------------|-----------------------------------------------------|
| 0     | 4 + 4 + 8               | 2 + 4 + 12            = 18Ψ                         |
| 1     | 4 + 4 + 8/N             | 2 + 4 + 12/N                                        |
| 2     | 4 + 4/N + 8/N           | 2 + 4/N + 12/N                                      |
| 3     | (4 + 4 + 8)/N           | (4 + 4 + 8)/N: FSDP2 keeps fp32 shards as the master and
|       |                         | accumulates fp32 gradient shards, the paper's 16Ψ/N |

The paper counts 2-byte gradients; we accumulate them in fp32 at every stage (a bf16 sum of many
micro-batches loses the small ones: DeepSpeed's ``data_types.grad_accum_dtype=fp32``), which costs
2Ψ more at stages 0-1 and 2Ψ/N more at stage 2.
With fp32 params the master weight *is* the param shard, so it is not counted twice.
Offloaded optimizer state is reported under ``host``/``nvme`` instead of ``optimizer``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from torch import nn

from deepshard.core.dtensor_utils import storage_bytes
from deepshard.core.state_store import StateStore
from deepshard.core.zero.stages import ZeroStage


@dataclass
class ModelStateBytes:
    """Per-rank bytes.  ``total`` is the model state the ZeRO formula describes; ``buffers`` (named in
    ``buffer_parts``) is everything else the engine holds alive between steps: communication bucket
    pools, all-gather buffers, the modules' registered buffers (RoPE tables).  ``live_total`` is both:
    what a census of live tensor storages finds (tests/core/test_memory_census.py)."""

    params: int
    grads: int
    optimizer: int  # master (when not aliased) + Adam moments held on the compute device
    host: int = 0  # optimizer state offloaded to host memory
    nvme: int = 0  # optimizer state offloaded to files
    buffer_parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.host

    @property
    def buffers(self) -> int:
        return sum(self.buffer_parts.values())

    @property
    def live_total(self) -> int:
        return self.total + self.buffers

    def as_dict(self) -> dict[str, int]:
        flat = {k: v for k, v in asdict(self).items() if k != "buffer_parts"}
        return {**flat, "total": self.total, "buffers": self.buffers, "live_total": self.live_total,
                **{f"buffers.{k}": v for k, v in self.buffer_parts.items()}}


def expected_bytes(stage: int, num_params: int, dp: int, dtype: str) -> ModelStateBytes:
    """The stage's expected per-rank model-state bytes (see the table above)."""
    mixed = dtype != "fp32"
    n = num_params
    if stage == 3:
        return ModelStateBytes(params=4 * n // dp, grads=4 * n // dp, optimizer=8 * n // dp)
    p = 2 if mixed else 4
    opt = 12 if mixed else 8
    return ModelStateBytes(
        params=p * n,
        grads=4 * n // dp if stage >= 2 else 4 * n,
        optimizer=opt * n // dp if stage >= 1 else opt * n,
    )


def module_buffer_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the modules' registered (non-parameter) buffers, each storage once."""
    return storage_bytes(b for m in modules for b in m.buffers())


def frozen_param_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the parameters that do not train (a LoRA run's base weights), this rank's pieces."""
    return storage_bytes(p.data for m in modules for p in m.parameters() if not p.requires_grad)


def measured_bytes(stage: ZeroStage, store: StateStore, modules: Iterable[nn.Module] = ()) -> ModelStateBytes:
    """Bytes the live tensors hold on this rank right now (call after backward to count grads)."""
    state = store.state_bytes()
    parts = {**stage.buffer_bytes(), **store.buffer_bytes()}
    modules = list(modules)
    for name, n in (("module_buffers", module_buffer_bytes(modules)), ("frozen_params", frozen_param_bytes(modules))):
        if n:
            parts[name] = n
    return ModelStateBytes(params=stage.param_bytes(), grads=stage.grad_bytes(), optimizer=state["device"],
                           host=state["host"], nvme=state["nvme"], buffer_parts=parts)


def model_state_memory(stage: ZeroStage, store: StateStore, *, num_params: int, dp: int, dtype: str,
                       modules: Iterable[nn.Module] = ()) -> dict[str, ModelStateBytes]:
    """``{"measured": ..., "expected": ...}`` per-rank model-state bytes (what ``memory()`` returns)."""
    return {"measured": measured_bytes(stage, store, modules),
            "expected": expected_bytes(stage.zero_stage, num_params, dp, dtype)}
