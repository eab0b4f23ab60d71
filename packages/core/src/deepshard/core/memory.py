"""Per-rank model-state bytes: the ZeRO paper's expectation beside what the live tensors hold, and the
estimates before a run (by residence, gathered units, gradients in flight) from the same counts.

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

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from deepshard.core.dtensor_utils import storage_bytes
from deepshard.core.state_store import StateStore
from deepshard.core.update_rule import UpdateRule
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


def rule_state_bytes(rule: UpdateRule, numels: Sequence[int]) -> int:
    """Bytes of ``rule``'s states for parameters of these (whole) sizes, in its state dtype: AdamW's two
    moments per parameter, Muon's one momentum per hidden matrix and AdamW's two on the rest."""
    size = rule.state_dtype.itemsize
    return sum(n * size for name in rule.states for i, n in enumerate(numels) if rule.holds(name, i))


def expected_bytes(stage: int, num_params: int, dp: int, dtype: str, *, states: int | None = None,
                   params_are_masters: bool = False) -> ModelStateBytes:
    """The stage's expected per-rank model-state bytes (see the table above).  ``states``: the update
    rule's state bytes for the whole model (:func:`rule_state_bytes`; default AdamW's fp32 moments, 8 B per
    parameter); ``params_are_masters``: bf16 states with bf16 params keep no fp32 master copy."""
    mixed = dtype != "fp32"
    n = num_params
    states = 8 * n if states is None else states
    if stage == 3:  # the fp32 shards are the masters
        return ModelStateBytes(params=4 * n // dp, grads=4 * n // dp, optimizer=states // dp)
    p = 2 if mixed else 4
    opt = states + (4 * n if mixed and not params_are_masters else 0)
    return ModelStateBytes(
        params=p * n,
        grads=4 * n // dp if stage >= 2 else 4 * n,
        optimizer=opt // dp if stage >= 1 else opt,
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
    rule = store.rule
    return {"measured": measured_bytes(stage, store, modules),
            "expected": expected_bytes(stage.zero_stage, num_params, dp, dtype,
                                       states=rule_state_bytes(rule, [p.numel() for p in stage.params]),
                                       params_are_masters=rule.state_dtype != torch.float32 and dtype != "fp32")}


# -- estimates before a run: what the ZeRO stages hold, by residence, from the counts alone ------------

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Residence:
    """Per-rank bytes of model states by where they live, for one stage and offload choice."""

    stage: int
    offload: str  # optimizer state: none | cpu | nvme
    offload_params: bool | str  # False/'none', True/'cpu' (FSDP2 CPU offload), 'nvme' (ZeRO-Infinity)
    device: int
    host: int
    nvme: int


def residence(num_params: int, *, stage: int, dp: int, dtype: str, offload: str = "none",
              offload_params: bool | str = False, nvme_buffer_bytes: int = 0, frozen_params: int = 0,
              param_buffer_bytes: int = 0, states: int | None = None,
              params_are_masters: bool = False, experts: int = 0, ep: int = 1,
              expert_states: int | None = None) -> Residence:
    """Where a rank's params, grads and optimizer state live for this choice (``num_params`` trainable
    per rank before data-parallel sharding, i.e. already divided by tp and pp).  ``nvme_buffer_bytes``
    and ``param_buffer_bytes``: the offload stores' host buffers (``deepshard.offload.memory``), which
    the offloaded states stream through.  ``frozen_params`` (a LoRA base): params only, in the compute
    dtype at stages 0-2, fp32 shards at stage 3 (FSDP2).  ``states``, ``params_are_masters``: the update
    rule's (:func:`expected_bytes`; the offloaded figure is AdamW's, the only rule offload runs).

    Expert parallelism (``ep`` > 1): ``experts`` of the ``num_params`` are this rank's experts (already
    1/ep of the model's), ZeRO-sharded over the ``dp / ep`` ranks left after ep (``zero.split``), the rest
    over all ``dp``; ``expert_states`` is the update rule's bytes for the experts (``states`` then covers
    the rest)."""
    if experts:
        assert ep >= 1 and dp % ep == 0 and 0 < experts <= num_params, (experts, ep, dp, num_params)
        kw = dict(stage=stage, dtype=dtype, offload=offload, offload_params=offload_params,
                  params_are_masters=params_are_masters)
        dense = residence(num_params - experts, dp=dp, nvme_buffer_bytes=nvme_buffer_bytes,
                          frozen_params=frozen_params, param_buffer_bytes=param_buffer_bytes, states=states, **kw)
        local = residence(experts, dp=dp // ep, states=expert_states, **kw)
        return Residence(stage, offload, offload_params, dense.device + local.device, dense.host + local.host,
                         dense.nvme + local.nvme)
    e = expected_bytes(stage, num_params, dp, dtype, states=states, params_are_masters=params_are_masters)
    frozen = 4 * frozen_params // dp if stage == 3 else (4 if dtype == "fp32" else 2) * frozen_params
    e.params += frozen
    device, host, nvme = e.params + e.grads + e.optimizer, 0, 0
    # offloaded: an fp32 master + two moments per sharded element (12 bytes; on a CPU-only host an fp32
    # master may alias the param, so that is an upper bound there)
    offloaded = 12 * num_params // dp
    if offload == "cpu":  # the Adam step runs on the host
        device, host = device - e.optimizer, host + offloaded
    elif offload == "nvme":  # in swap files, streamed through a few host buffers
        device, nvme, host = device - e.optimizer, nvme + offloaded, host + min(nvme_buffer_bytes, offloaded)
    if offload_params == "nvme":  # params (the fp32 masters), grads and moments in swap files: 16 B/elt
        states = 16 * num_params // dp + 4 * frozen_params // dp
        return Residence(stage, offload, "nvme", 0, param_buffer_bytes, states)
    if offload_params:  # FSDP2 CPUOffloadPolicy: sharded params and their grads rest on the host
        device, host = device - e.params - e.grads, host + e.params + e.grads
    return Residence(stage, offload, offload_params, device, host, nvme)


def gathered_unit_bytes(unit_numel: int, *, prefetch: int, dtype: str, phase: str = "backward") -> int:
    """ZeRO-3's all-gathered units at their peak in ``phase``, as FSDP2 allocates them (torch 2.13's
    ``_fully_shard``; bench/bench_memory_table.py measures them).

    An unshard all-gathers into one buffer of the whole unit and copies out into the parameters' own
    unsharded storage: both exist at the copy-out.  ``prefetch`` (``zero.prefetch``) units are
    all-gathered ahead explicitly; with 0, ``apply_fsdp`` sets none and FSDP2 still gathers the next unit
    of backward itself (its default), so backward holds one ahead either way.

    - forward: the unit in use, and the prefetched units' all-gather buffers or, at 0, the unit's own
      (at its copy-out): ``(1 + max(prefetch, 1))`` units in the compute dtype;
    - backward: the unit in use and ``max(prefetch, 1)`` ahead in the compute dtype, the unit's unsharded
      fp32 gradient, and the previous unit's fp32 reduce-scatter input, which FSDP2 holds until this
      unit's reduce-scatter starts (``reduce_scatter_max_input_buffers=1``, for overlap).

    What a working set holds only in forward (ZeRO-Infinity's deferred update) meets the forward's
    figure, not the backward's."""
    assert phase in ("forward", "backward"), phase
    gathered, grad = unit_numel * DTYPE_BYTES[dtype], unit_numel * 4
    if phase == "forward":
        return (1 + max(prefetch, 1)) * gathered
    return (1 + max(prefetch, 1)) * gathered + 2 * grad


def grads_in_flight_bytes(num_params: int, *, stage: int, dp: int, reduce_bucket_size: int) -> int:
    """Stages 0-2: autograd's fp32 gradients before the reducer folds them into its buckets (measured:
    one full gradient at the peak), and at dp > 1 a packing buffer of about a bucket."""
    bucket = 4 * min(reduce_bucket_size, num_params) if dp > 1 and stage > 0 else 0
    return 4 * num_params + bucket
