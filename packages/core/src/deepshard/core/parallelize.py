"""The one place the order of a model's parallelisms is written: TP, activation checkpointing,
compile, precision, ZeRO (torchtitan's ``parallelize_llama`` order).

A model family wraps :func:`parallelize_model` with its TP plan (the app's ``parallelize_llama``);
``deepshard.core.initialize`` and ``deepshard.pipeline.build_pipeline`` both take that function as
their ``parallelize_fn``, so a data-parallel run, a tensor-parallel one and every pipeline stage are
assembled by the same code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from deepshard.core.activation_checkpoint import apply_ac
from deepshard.core.compile import apply_compile
from deepshard.core.config import ZeroConfig
from deepshard.core.mesh import expert_meshes, zero_mesh
from deepshard.core.mixed_precision import apply_mixed_precision
from deepshard.core.precision import DTYPES
from deepshard.core.step import IGNORE_INDEX, num_params
from deepshard.core.tensor_parallel import apply_tp
from deepshard.core.zero import ParamOffload, ZeroStage, apply_zero
from deepshard.core.zero.hsdp import hsdp_mesh
from deepshard.core.zero.split import check_experts, expert_layout

__all__ = ["IGNORE_INDEX", "ShardedPart", "find_blocks", "parallelize_model"]


@dataclass
class ShardedPart:
    """What a ``parallelize_fn`` returns for a model (or a pipeline stage of one).

    ``fp32_masters``: for bf16/fp16 at stages 0-2, the fp32 master shards
    :func:`apply_mixed_precision` kept, so the masters start from the exact init.
    ``num_params``: Ψ of the README's ZeRO table for this rank, the trainable elements it holds
    after TP and before data-parallel sharding (None: count the stage's params).
    """

    zero: ZeroStage
    fp32_masters: list[torch.Tensor] | None = None
    num_params: int | None = None


def find_blocks(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks: ``model.layers`` by convention (torchtitan and HF Llama agree)."""
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError("initialize(): pass blocks= explicitly, the model has no `layers` ModuleList")
    return blocks


def parallelize_model(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    zero: ZeroConfig,
    dtype: str = "fp32",
    ac: str = "none",
    blocks: Sequence[nn.Module] | nn.Module | None = None,
    tp_plan: Mapping[str, ParallelStyle] | None = None,
    offload_params: ParamOffload | None = None,
    ac_offload: bool = False,
    experts: Sequence[nn.Module] = (),
    compile: bool = False,
) -> ShardedPart:
    """TP over ``mesh["tp"]`` (when the mesh has that axis and ``tp_plan`` is given), activation
    checkpointing of ``blocks``, ``torch.compile`` per block (``compile``), precision, then ZeRO over ``mesh["dp"]`` (``dp x sp`` with sequence
    parallelism: :func:`deepshard.core.mesh.zero_mesh`); in place.

    ``model`` is fp32, with real weights or on the meta device (ZeRO-3's sharded init).
    ``experts``: with ``parallel.ep > 1``, the modules holding this rank's experts; ZeRO shards their
    params over ``mesh["edp"]`` (the dp ranks left after ep), the rest over dp.
    """
    names = mesh.mesh_dim_names or ()
    tp_size = mesh["tp"].size() if "tp" in names else 1
    if tp_size > 1:
        if tp_plan is None:
            raise ValueError(f"parallel.tp={tp_size}: this model has no tensor-parallel plan")
        apply_tp(model, mesh["tp"], tp_plan)
    blocks = find_blocks(model) if blocks is None else blocks
    if isinstance(blocks, nn.Module):
        apply_ac(blocks, ac, offload=ac_offload)
    elif ac != "none" or compile:
        raise ValueError("ac and compile need the blocks as an nn.ModuleList or ModuleDict")
    if compile:  # after TP and AC (the checkpoint is traced into the graph), before ZeRO's hooks
        # DTensor weights: a static graph per length (a symbolic one fails to compile on torch 2.13), and the
        # checkpoint left eager around the compiled block (traced with it, AOT autograd saves the weights'
        # DeviceMesh among the tensors for backward and fails: "expected all tensors_saved_with_vc_check")
        apply_compile(blocks, inside_checkpoint=ac_offload or tp_size > 1, dynamic=False if tp_size > 1 else None)
    psi = num_params(p for p in model.parameters() if p.requires_grad)
    dp_mesh = zero_mesh(mesh)  # dp, or dp x sp flattened: sequence-parallel ranks share the shards
    torch_dtype = DTYPES[dtype]
    meshes = expert_meshes(mesh)
    if meshes is None:
        experts = ()
    elif experts:
        check_experts(zero, dtype=dtype, hsdp=hsdp_mesh(mesh) is not None, offload_params=offload_params is not None)
    fp32_masters = apply_mixed_precision(model, dp_mesh, zero_stage=zero.stage, dtype=torch_dtype)  # before ZeRO
    stage = apply_zero(model, dp_mesh, zero, blocks=list(blocks), param_dtype=torch_dtype,
                       offload_params=offload_params, shard_mesh=hsdp_mesh(mesh), experts=experts,
                       expert_mesh=None if meshes is None else meshes[1])
    if experts:  # checkpoints write the experts as canonical [num_experts, ...] tensors (layout-free)
        owned = {id(p) for m in experts for p in m.parameters()}
        names = {n for n, p in model.named_parameters() if id(p) in owned}
        stage.expert_layout = expert_layout(meshes[0], meshes[1], mesh["edp", "ep"], names)
    return ShardedPart(stage, fp32_masters, psi)
