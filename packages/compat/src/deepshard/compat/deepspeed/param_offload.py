"""``optimizer.parameter_offload`` at ZeRO-3: the part of DeepSpeed's ``DeepSpeedZeRoOffload`` that TRL's
generation reaches (issue 41).

TRL's ``unwrap_model_for_generation`` gathers every parameter (``zero.GatheredParameters``), then removes
the engine's ZeRO-3 hooks so that generating token after token does not gather and release each block
again, and puts them back after (``trl.models.utils.remove_hooks``/``add_hooks``).  On FSDP2 the hooks are
FSDP's own per unit (the blocks and the root); "removing" one means: gather the unit once and keep it
gathered across forwards; "registering" the module again restores each unit's own resharding and frees the
gathered copy.  FSDP2 records no trace of the module order (its prefetching is set explicitly), so the
coordinator's trace is always invalid and there is nothing to invalidate.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule

from . import zero


class _UnitHook:
    """One FSDP2 unit's gather/release around forward, as a removable hook handle."""

    def __init__(self, unit: FSDPModule, removed: list[_UnitHook]) -> None:
        self.unit = unit
        self.removed = removed  # the owner's hooks removed since the last registration
        self.kept: list[Any] | None = None  # each param group's post-forward reshard mesh while removed

    def remove(self) -> None:
        if self.kept is not None:
            return
        # FSDP2 has no public getter, and set_reshard_after_forward takes a bool (hpZ's int would be lost):
        # keep each group's post-forward mesh as it is and restore it unchanged
        groups = self.unit._get_fsdp_state()._fsdp_param_groups
        self.kept = [g.post_forward_mesh_info for g in groups]
        for g in groups:
            g.post_forward_mesh_info = None  # FSDP2's "do not reshard after forward"
        self.unit.unshard()
        self.removed.append(self)

    def restore(self) -> None:
        if self.kept is None:
            return
        for g, kept in zip(self.unit._get_fsdp_state()._fsdp_param_groups, self.kept, strict=True):
            g.post_forward_mesh_info = kept
        self.kept = None
        self.unit.reshard()


class ParamCoordinator:
    """DeepSpeed's ``PartitionedParameterCoordinator`` as far as callers query it."""

    def is_invalid_trace(self) -> bool:
        return True  # FSDP2 records no module-order trace

    def _invalidate_trace(self) -> None:
        raise RuntimeError("attempted to invalidate already invalid trace")  # DeepSpeed's own message


class ParameterOffload:
    """``engine.optimizer.parameter_offload``: ``module``, ``forward_hooks`` (one per FSDP2 unit),
    ``backward_hooks`` (none: FSDP2's backward hooks are attached by autograd during a forward with grad),
    ``param_coordinator`` and ``_register_deepspeed_module``."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.param_coordinator = ParamCoordinator()
        self.forward_hooks: list[_UnitHook] = []
        self.backward_hooks: list[Any] = []
        self._removed: list[_UnitHook] = []
        _add_external_parameters(module)
        self._register_deepspeed_module(module)

    def get_param_coordinator(self) -> ParamCoordinator:
        return self.param_coordinator

    def _register_deepspeed_module(self, module: nn.Module, count: list[int] | None = None) -> None:
        """Hooks back on ``module``'s units: each restored to its own resharding and released."""
        units = [m for m in module.modules() if isinstance(m, FSDPModule)]
        for hook in list(self._removed):  # TRL removed them (hook.remove() on each) before generating
            if any(hook.unit is u for u in units):
                hook.restore()
                self._removed.remove(hook)
        self.forward_hooks = [_UnitHook(u, self._removed) for u in units]


def _add_external_parameters(module: nn.Module) -> None:
    """DeepSpeed's ``module.ds_external_parameters()``: ``(key, parameter)`` pairs registered with
    ``zero.register_external_parameter`` on this module."""
    if "ds_external_parameters" in module.__dict__:
        return

    def ds_external_parameters() -> list[tuple[str, nn.Parameter]]:
        return [(str(id(p)), p) for p in zero.external_parameters(module)]
    module.ds_external_parameters = ds_external_parameters


def attach(optimizer: Any, module: nn.Module) -> None:
    """At ZeRO-3, the engine's optimizer carries ``parameter_offload`` as DeepSpeed's ZeRO-3 optimizer does."""
    optimizer.parameter_offload = ParameterOffload(module)
