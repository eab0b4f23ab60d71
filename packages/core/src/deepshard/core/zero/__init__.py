"""ZeRO stages on DTensor placements: build one with :func:`apply_zero`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deepshard.core.config import ZeroConfig
from deepshard.core.dtensor_utils import local_tensor
from deepshard.core.precision import DTYPES
from deepshard.core.zero.composite import CompositeStage
from deepshard.core.zero.fsdp import (
    CpuParamOffload,
    FullyShardedStage,
    ParamOffload,
    apply_fsdp,
    shard_experts,
)
from deepshard.core.zero.gather import ShardGatherer, forward_units
from deepshard.core.zero.handoff import GradHandoff
from deepshard.core.zero.hsdp import hpz_reshard
from deepshard.core.zero.reducer import AllReduceReducer, FullGradScatterReducer, ReduceScatterReducer
from deepshard.core.zero.split import check_experts
from deepshard.core.zero.stages import (
    ReplicatedStage,
    ShardedGradStage,
    ShardedOptimizerStage,
    ZeroStage,
    trainable,
)

__all__ = ["CpuParamOffload", "GradHandoff", "ParamOffload", "CompositeStage", "ZeroStage", "apply_fsdp", "apply_zero"]


def apply_zero(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    config: ZeroConfig,
    *,
    blocks: Sequence[nn.Module] = (),
    param_dtype: torch.dtype = torch.float32,
    offload_params: ParamOffload | None = None,
    shard_mesh: DeviceMesh | None = None,
    experts: Sequence[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> ZeroStage:
    """Make ``model`` data-parallel over ``dp_mesh`` at ``config.stage``; returns the stage handle,
    built from its parts (stages 1-2: a reducer and a gatherer; stage 2's reducer hands final
    gradient shards over during backward through a GradHandoff the optimizer binds to its store).

    Stages 0-2 expect the model already in its compute dtype; stage 3 expects fp32 params and
    casts to ``param_dtype`` per all-gather (FSDP2's MixedPrecisionPolicy).  ``shard_mesh``: the 2-D
    ``(dp_replicate, dp_shard)`` mesh of HSDP (zero.hsdp), stage 3 only; default ``dp_mesh``.

    ``experts`` (MoE with expert parallelism): modules holding this rank's experts, whose params are
    ZeRO-sharded over ``expert_mesh`` (the dp ranks left after ep, torchtitan's layout) instead of
    ``dp_mesh``: stage 3 shards them with their own FSDP2 units; stages 0-2 reduce them in their own
    group (a :class:`CompositeStage` of the two parts).
    """
    reduce_dtype = DTYPES[config.reduce_dtype]
    if experts:
        assert expert_mesh is not None, "experts need their mesh"
        check_experts(config, dtype="fp32" if param_dtype == torch.float32 else str(param_dtype),
                      hsdp=shard_mesh is not None, offload_params=offload_params is not None)
    if shard_mesh is not None and config.stage != 3:
        raise ValueError(f"HSDP (parallel.dp_replicate > 1) needs zero.stage=3 (got zero.stage={config.stage})")
    if config.stage == 3:
        mesh = dp_mesh if shard_mesh is None else shard_mesh
        if experts:  # before the blocks: FSDP2 leaves params a nested unit owns to that unit
            shard_experts(experts, expert_mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        gather = None
        if config.quantized_weights:  # ZeRO++ (imports deepshard.kernels)
            from deepshard.core.zero.quantized import zeropp_all_gather

            gather = zeropp_all_gather(mesh)
        apply_fsdp(model, blocks, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=hpz_reshard(config, mesh, offload_params=offload_params is not None),
                   offload_params=offload_params,
                   prefetch=config.prefetch, all_gather=gather)
        feedback = None
        if config.quantized_gradients:  # qgZ per unit, across HSDP's replicas too; LoCo's buffers (zero.loco)
            from deepshard.core.zero.loco import ErrorFeedback
            from deepshard.core.zero.replica_reduce import attach_qgz

            feedback = ErrorFeedback(err_beta=config.loco_err_beta, reset_t=config.loco_reset_t) if config.loco else None
            attach_qgz([*blocks, model], mesh, bits=config.quantized_gradients_bits,
                       node_size=config.quantized_gradients_node_size, feedback=feedback)
        stage = FullyShardedStage(model, param_offload=offload_params, error_feedback=feedback)
        stage.expert_parallel = bool(experts)
        return stage
    if offload_params is not None:
        raise ValueError(f"offload.params=cpu needs zero.stage=3 (got zero.stage={config.stage})")
    names, params = trainable(model)
    if not experts:
        return _bucketed(model, names, params, dp_mesh, config, blocks=blocks, reduce_dtype=reduce_dtype)
    owned = {id(p) for m in experts for p in m.parameters()}
    dense = [(n, p) for n, p in zip(names, params) if id(p) not in owned]
    moe = [(n, p) for n, p in zip(names, params) if id(p) in owned]
    parts = [_bucketed(model, [n for n, _ in group], [p for _, p in group], mesh, config, blocks=blocks,
                       reduce_dtype=reduce_dtype, overlap=i == 0 and config.overlap_allgather)
             for i, (group, mesh) in enumerate(((dense, dp_mesh), (moe, expert_mesh)))]
    stage = CompositeStage(parts)
    stage.expert_parallel = True
    return stage


def _bucketed(model: nn.Module, names: list[str], params: list[nn.Parameter], dp_mesh: DeviceMesh,
              config: ZeroConfig, *, blocks: Sequence[nn.Module], reduce_dtype: torch.dtype,
              overlap: bool | None = None) -> ZeroStage:
    """Stages 0-2 over ``params`` (the model's, or one part of them) and ``dp_mesh``'s group."""
    overlap = config.overlap_allgather if overlap is None else overlap
    group = dp_mesh.get_group()
    reducer_kwargs = dict(reduce_bucket_size=config.reduce_bucket_size, overlap=config.overlap_comm,
                          reduce_dtype=reduce_dtype)
    if config.stage == 2:
        reducer = ReduceScatterReducer(params, group, handoff=GradHandoff(), **reducer_kwargs)
    elif config.stage == 1:  # full grads accumulate; reduce-scattered at the boundary (DeepSpeed's stage 1)
        reducer = FullGradScatterReducer(params, group, **reducer_kwargs)
    else:
        reducer = AllReduceReducer(params, group, **reducer_kwargs)
    if config.stage == 0:
        return ReplicatedStage(names, params, reducer=reducer)
    locals_ = [local_tensor(p.data) for p in params]
    # overlap_allgather: gathered unit by unit inside the next forward (see zero/gather.py)
    order, units = forward_units(model, params, list(blocks)) if overlap else (None, [])
    gatherer = ShardGatherer(locals_, group, allgather_bucket_size=config.allgather_bucket_size, order=order)
    if overlap:
        gatherer.hook_forward(model, units)
    cls = ShardedOptimizerStage if config.stage == 1 else ShardedGradStage
    return cls(names, params, reducer=reducer, gatherer=gatherer, gather_in_forward=overlap)
