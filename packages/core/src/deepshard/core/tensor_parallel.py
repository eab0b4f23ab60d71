"""Tensor parallelism: a plan of ParallelStyles applied with ``parallelize_module`` on the ``tp`` axis.

Core offers the mechanism; which module gets which style is model knowledge and lives with the
model in the app (e.g. ``llama_tp_plan``).  One style is added here, :class:`ReplicateParallel`,
for modules whose weights every tp rank holds whole (norms): their parameters become Replicate
DTensors, so ZeRO's replication factors count their gradients once per tp group when clipping,
while the module still takes and returns plain tensors.  :class:`ColwiseWithChildren` and
:class:`RowwiseWithChildren` shard a linear layer as torch's Colwise/Rowwise styles do and give
its child modules' parameters (a LoRA layer's ``lora_A``/``lora_B``) placements of their own; the
child modules then compute on the same DTensor input inside the parent's forward, so whatever they
add to the output joins the base output before the style's output redistribution (one reduction).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

__all__ = ["ColwiseWithChildren", "ReplicateParallel", "RowwiseWithChildren", "apply_tp"]


def _to_replicate(module: nn.Module, inputs: Any, mesh: DeviceMesh) -> Any:
    return tuple(DTensor.from_local(t, mesh, (Replicate(),), run_check=False) if _plain(t) else t
                 for t in inputs)


def _to_local(module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
    return outputs.to_local() if isinstance(outputs, DTensor) else outputs


def _plain(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, DTensor)


class ReplicateParallel(ParallelStyle):
    """Every tp rank holds the whole module: params become Replicate DTensors, inputs are wrapped
    as Replicate and the output is handed back as a local tensor.

    Backward of ``from_local(Replicate)`` adds nothing, which is right because the gradient flowing
    into a replicated module (a norm between two TP blocks) is already identical on every tp rank.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_to_replicate, output_fn=_to_local)


def _distribute_own(module: nn.Module, mesh: DeviceMesh, placements: Mapping[str, Placement]) -> None:
    """``module``'s own parameters (not its children's) as DTensors, ``requires_grad`` kept (a frozen
    base stays frozen)."""
    for name, param in list(module.named_parameters(recurse=False)):
        dist = distribute_tensor(param.detach(), mesh, [placements[name]])
        module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))


class _WithChildren:
    """Mixin: the base layer's ``weight``/``bias`` get ``own`` placements, each named child's
    parameters ``children[name]``; a layer without those children is sharded exactly as the parent
    style shards it."""

    own: dict[str, Placement]

    def __init__(self, *, children: Mapping[str, Placement], **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[call-arg]
        self.children = dict(children)

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if name in self.children:
            _distribute_own(module, device_mesh, {n: self.children[name] for n, _ in module.named_parameters(
                recurse=False)})
        elif name == "":
            _distribute_own(module, device_mesh, self.own)
        else:
            assert not list(module.parameters(recurse=False)), f"no placement for the parameters of child {name!r}"


class ColwiseWithChildren(_WithChildren, ColwiseParallel):
    """ColwiseParallel (weight and bias Shard(0): output features) plus placements for named children."""

    own = {"weight": Shard(0), "bias": Shard(0)}


class RowwiseWithChildren(_WithChildren, RowwiseParallel):
    """RowwiseParallel (weight Shard(1): input features, bias Replicate) plus placements for named children."""

    own = {"weight": Shard(1), "bias": Replicate()}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]) -> nn.Module:
    """Shard ``model`` in place over ``tp_mesh`` by ``plan`` (FQN patterns -> styles), torchtitan's
    ``apply_tp``.  A size-1 tp axis leaves the model untouched (plain tensors, no DTensor cost).

    DTensor params get a hook keeping their gradient in their own placements.
    Every parameter left out of the plan stays a plain tensor: give replicated modules a
    :class:`ReplicateParallel` entry, otherwise gradient clipping counts them once per tp rank.
    """
    if tp_mesh.size() == 1:
        return model
    parallelize_module(model, tp_mesh, dict(plan))
    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_post_accumulate_grad_hook(_grad_like_param)
    return model


def _grad_like_param(p: torch.Tensor) -> None:
    """Give the gradient its parameter's placements.

    Some backward rules pick another layout (a vocab-sharded embedding's weight gradient comes
    back Replicate); ZeRO's reducers work on local tensors and need the param's layout.  Registered
    before ZeRO's own hooks, so it runs first; Replicate -> Shard is a local slice, no communication.
    """
    g = p.grad
    if isinstance(g, DTensor) and g.placements != p.placements:
        p.grad = g.redistribute(p.device_mesh, p.placements)
