"""``deepspeed.zero.Init`` and ``deepspeed.zero.GatheredParameters`` on FSDP2 (ZeRO-3).

``Init()``: parameters of modules built inside it are created on the meta device (no memory);
buffers (RoPE tables) stay real and are kept.  ``deepspeed.initialize`` then shards the model and
materializes each rank's shards only (core's meta-device path), re-running each module's own
initializer on the shards (``reset_parameters``, or an HF model's ``_init_weights``).  So no rank
ever holds a whole parameter.  The values are drawn per shard: same distribution as a plain build,
not the same numbers (load pretrained weights after initialize for exact values).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

_SAVED_BUFFERS: weakref.WeakKeyDictionary[nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


class Init:
    """Context manager: models built inside have meta parameters until ``deepspeed.initialize``."""

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None, remote_device: Any = None,
                 pin_memory: bool = False, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None) -> None:
        if module is not None:
            raise ValueError("zero.Init(module=...): not supported; build the model inside `with zero.Init():`")
        if remote_device not in (None, "none", "cpu"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}): valid values are None, 'cpu' "
                             f"(offload_param.device=cpu in the ds_config)")
        self.enabled = enabled
        self._original = nn.Module.register_parameter
        self._original_buffer = nn.Module.register_buffer

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        original = self._original

        def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            original(module, name, param)
            if param is not None and not param.is_meta:
                module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            _SAVED_BUFFERS.setdefault(module, {})

        original_buffer = self._original_buffer

        def register_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
            original_buffer(module, name, tensor, persistent)
            _SAVED_BUFFERS.setdefault(module, {})  # kept, to be restored after the sharded build's to_empty

        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        nn.Module.register_parameter = self._original  # type: ignore[method-assign]
        nn.Module.register_buffer = self._original_buffer  # type: ignore[method-assign]
        if self.enabled:
            for module in list(_SAVED_BUFFERS.keys()):
                _SAVED_BUFFERS[module] = {k: b.detach().clone() for k, b in module._buffers.items()
                                          if b is not None and not b.is_meta}


def built_under_init(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def materialize(model: nn.Module) -> None:
    """Restore the buffers saved at construction and initialize each rank's parameter shards."""
    init_weights = getattr(model, "_init_weights", None)
    for module in model.modules():
        for name, saved in _SAVED_BUFFERS.get(module, {}).items():
            buf = module._buffers.get(name)
            if buf is not None:
                buf.copy_(saved.to(buf.device))
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        if callable(init_weights) and module is not model:
            init_weights(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _owners(params: list[torch.Tensor]) -> dict[int, list[tuple[nn.Module, str]]]:
    """Where each parameter is registered (module, attribute name), found through the engines' models
    and the modules built under Init."""
    wanted = {id(p) for p in params}
    found: dict[int, list[tuple[nn.Module, str]]] = {}
    roots = [e.module for e in list(_ENGINES)] + list(_SAVED_BUFFERS.keys())
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for name, p in module._parameters.items():
                if p is not None and id(p) in wanted:
                    found.setdefault(id(p), []).append((module, name))
    return found


@contextmanager
def GatheredParameters(params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None,
                       fwd_module: Any = None, enabled: bool = True) -> Iterator[None]:  # noqa: N802 - DeepSpeed's name
    """Inside the block each ZeRO-3 parameter's module holds the full value (reach it through its
    module, ``model.embed.weight``: FSDP2 keeps the sharded parameter a DTensor, which cannot change
    shape in place as DeepSpeed's does); on exit it is re-sharded, keeping the changes made on
    ``modifier_rank`` (broadcast to every rank); with ``modifier_rank=None`` changes are discarded,
    as in DeepSpeed.  Parameters that are not sharded (stages 0-2) are broadcast from
    ``modifier_rank`` on exit.  The optimizer's fp32 masters follow the change."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if not enabled:
        yield
        return
    sharded = [p for p in params if isinstance(p, DTensor)]
    owners = _owners(sharded)
    fulls = {}
    for p in sharded:
        full = nn.Parameter(p.full_tensor().detach().clone(), requires_grad=False)
        fulls[id(p)] = full
        for module, name in owners.get(id(p), []):
            module._parameters[name] = full
    try:
        yield
    finally:
        for p in sharded:
            full = fulls[id(p)]
            for module, name in owners.get(id(p), []):
                module._parameters[name] = p
            if modifier_rank is not None:
                data = full.detach()
                dist.broadcast(data, src=modifier_rank)
                shard = distribute_tensor(data, p.device_mesh, p.placements).to_local()
                with torch.no_grad():
                    p.to_local().copy_(shard)
        if modifier_rank is not None and dist.is_initialized():
            for p in params:
                if not isinstance(p, DTensor):
                    dist.broadcast(p.data, src=modifier_rank)
        _sync_fp32_masters(params, modifier_rank)


_ENGINES: weakref.WeakSet = weakref.WeakSet()


def _sync_fp32_masters(params: list[nn.Parameter], modifier_rank: int | None) -> None:
    """Modified weights must reach the optimizer's fp32 masters too (engines register here)."""
    if modifier_rank is None or not params:
        return
    for engine in list(_ENGINES):
        engine.sync_masters_from_params(params)
