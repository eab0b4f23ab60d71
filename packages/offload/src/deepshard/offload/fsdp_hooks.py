"""Every touch of FSDP2's (and torch's) private internals that the parameter swap needs, in one place.

The swap moves each FSDP2 unit's shards between NVMe and memory at the right moments, which FSDP2
offers no public hook for: it wraps three methods of each unit's ``FSDPParamGroup`` on the
instance (never the class), reads the training state and the FSDPParams' shard storages, and
frees and refills those storages.  Nothing else in offload names a private torch attribute; when
a torch upgrade moves one, tests/offload/test_fsdp_hooks_contract.py names it (:data:`PRIVATE`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from deepshard.core.dtensor_utils import local_tensor

# what this module relies on, by owner: checked against the installed torch by the contract test
PRIVATE: dict[str, tuple[str, ...]] = {
    "torch.distributed.fsdp._fully_shard._fsdp_common": ("TrainingState.PRE_BACKWARD",),
    "FSDPModule": ("_get_fsdp_state",),
    "FSDPState": ("_fsdp_param_group", "_lazy_init"),
    "FSDPParamGroup": ("unshard", "wait_for_unshard", "post_backward", "fsdp_params", "is_sharded",
                       "is_unsharded", "_training_state"),
    "FSDPParam": ("_sharded_param_data", "sharded_param"),
    "torch.autograd": ("_unsafe_preserve_version_counter",),
    "torch.UntypedStorage": ("_cdata",),
    "DTensor": ("_local_tensor",),
    "torch._ops.OpOverload": ("_schema",),
    "torch": ("_foreach_norm",),
}
HOOKED = ("unshard", "wait_for_unshard", "post_backward")  # wrapped on each group instance


def param_group(module: nn.Module) -> Any | None:
    """The module's ``FSDPParamGroup`` (None: a ``fully_shard`` unit without params of its own, or
    not a unit at all)."""
    get_state = getattr(module, "_get_fsdp_state", None)
    return None if get_state is None else get_state()._fsdp_param_group


def is_unit(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module``."""
    return hasattr(module, "_get_fsdp_state")


def lazy_init(model: nn.Module) -> None:
    """FSDP2's lazy init now (it re-pads the shards: do it while they exist)."""
    model._get_fsdp_state()._lazy_init()


def _wrap(obj: Any, name: str, *, before: Callable[[], None] | None = None,
          after: Callable[[], None] | None = None) -> None:
    """Replace ``obj.name`` on the instance by the same bound method with hooks around it."""
    orig = getattr(obj, name)

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        out = orig(*args, **kwargs)
        if after is not None:
            after()
        return out

    setattr(obj, name, wrapped)


def hook_group(group: Any, *, before_unshard: Callable[[], None], after_unshard: Callable[[], None],
               after_post_backward: Callable[[], None]) -> None:
    """Run ``before_unshard`` before the group's all-gather is issued, ``after_unshard`` once its
    output holds the params (after ``wait_for_unshard``), ``after_post_backward`` after its
    gradients' reduce-scatter."""
    for attr in (*HOOKED, "fsdp_params", "is_sharded", "is_unsharded", "_training_state"):
        assert hasattr(group, attr), f"torch's FSDPParamGroup has no {attr}: offload.fsdp_hooks needs updating"
    _wrap(group, "unshard", before=before_unshard)
    _wrap(group, "wait_for_unshard", after=after_unshard)
    _wrap(group, "post_backward", after=after_post_backward)


def group_params(group: Any) -> list[Any]:
    """The group's FSDPParams, in FSDP2's order."""
    return list(group.fsdp_params)


def is_sharded(group: Any) -> bool:
    return bool(group.is_sharded)


def is_unsharded(group: Any) -> bool:
    return bool(group.is_unsharded)


def in_backward(group: Any) -> bool:
    """Whether the group is being unsharded for backward (so units come in reverse order)."""
    return group._training_state == TrainingState.PRE_BACKWARD


def shard_data(fsdp_param: Any) -> torch.Tensor:
    """The FSDPParam's padded flat shard: the storage the swap frees and refills."""
    return fsdp_param._sharded_param_data


def local_numel(fsdp_param: Any) -> int:
    """Elements of the shard proper (without FSDP2's padding)."""
    return local_tensor(fsdp_param.sharded_param).numel()


def shard_width(fsdp_param: Any) -> int:
    """Row length of a 2-D sharded weight (the tiled vocabulary's rows)."""
    return fsdp_param.sharded_param.shape[1]


def take_local_grad(fsdp_param: Any) -> torch.Tensor | None:
    """The reduced local gradient shard (after CPUOffloadPolicy's device->host copy landed)."""
    event = getattr(fsdp_param, "grad_offload_event", None)
    if event is not None:
        event.synchronize()
    g = fsdp_param.sharded_param.grad
    return None if g is None else local_tensor(g)


def drop_grad(fsdp_param: Any) -> None:
    fsdp_param.sharded_param.grad = None


def storage_key(t: torch.Tensor) -> int:
    """A key for the storage of ``t`` that stays the same while the storage is freed and refilled
    (its data pointer does not)."""
    return t.untyped_storage()._cdata


def preserve_version(t: torch.Tensor) -> Any:
    """A context in which writing into ``t`` leaves its version counter alone: the swap refills a
    shard autograd saved, with the same values."""
    return torch.autograd._unsafe_preserve_version_counter(t)


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local tensor behind a DTensor an op is dispatched on, without an op of its own (inside a
    dispatch mode), or ``t`` itself."""
    return getattr(t, "_local_tensor", t)


def mutates(func: Any) -> bool:
    """Whether the dispatched op writes into an argument (its schema says so)."""
    return bool(func._schema.is_mutable)


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 2-norm of each tensor, in one fused op (what torch's own grad clipping uses)."""
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
