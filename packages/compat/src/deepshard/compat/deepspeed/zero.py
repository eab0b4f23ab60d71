"""``deepspeed.zero.Init`` and ``deepspeed.zero.GatheredParameters`` on FSDP2 (ZeRO-3).

``Init()``: parameters of modules built inside it are created on the meta device (no memory);
buffers (RoPE tables) stay real and are kept.  ``deepspeed.initialize`` then shards the model and
materializes each rank's shards only (core's meta-device path), re-running each module's own
initializer on the shards (``reset_parameters``, or an HF model's ``_init_weights``).  So no rank
ever holds a whole parameter.  The values are drawn per shard: same distribution as a plain build,
not the same numbers.  Pretrained weights written inside ``GatheredParameters(..., modifier_rank=r)``
before ``initialize`` (DeepSpeed's documented order) are kept: rank ``r``'s values are broadcast and
sharded at ``initialize``, after the initializers ran.
"""

from __future__ import annotations

import enum
import itertools
import os
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from deepshard.core.mesh import local_device

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


def made_under_init(module: nn.Module) -> bool:
    """Whether ``module`` itself was built inside ``zero.Init()`` (its parameters wait on the meta device)."""
    return module in _SAVED_BUFFERS


def keep_real_params(model: nn.Module) -> None:
    """Parameters made outside ``zero.Init()`` on a model built under it (PEFT's adapters, added after
    ``from_pretrained``) keep their values through ``initialize``: rank 0's, broadcast by ``materialize``,
    as DeepSpeed broadcasts rank 0's value of a parameter it partitions at ``initialize``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    for module in model.modules():
        written = _WRITTEN.setdefault(module, {})
        for name, p in module._parameters.items():
            if p is not None and not p.is_meta and name not in written:
                written[name] = (0, p.detach().clone() if rank == 0 else None)


def materialize(model: nn.Module) -> None:
    """Restore the buffers saved at construction and initialize each rank's parameter shards; then
    the values written in ``GatheredParameters`` before ``initialize`` replace the initializers'."""
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
    for module in model.modules():  # same order on every rank: the broadcasts pair up
        for name, (src, value) in sorted(_WRITTEN.pop(module, {}).items()):
            p = module._parameters[name]
            device = local_device()  # a broadcast's tensor lives on the compute device (nccl takes no host tensor)
            full = value.to(device) if dist.get_rank() == src else torch.empty(p.shape, dtype=p.dtype, device=device)
            dist.broadcast(full, src=src)
            local = distribute_tensor(full, p.device_mesh, p.placements).to_local() if isinstance(p, DTensor) else full
            local_tensor_of(p).copy_(local)


# Values written in GatheredParameters before initialize, per module and parameter name: (modifier_rank,
# the full value on that rank, None elsewhere); consumed by materialize.
_WRITTEN: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[int, torch.Tensor | None]]] = \
    weakref.WeakKeyDictionary()


def local_tensor_of(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p.data


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
    """Inside the block each ZeRO-3 parameter is the full tensor, as in DeepSpeed: ``p.data``,
    ``p.shape``, ``model.embed.weight`` and ``state_dict()`` all read it (the parameter object is
    swapped in place with a full copy and swapped back on exit).  On exit it is re-sharded, keeping the
    changes made on ``modifier_rank`` (broadcast to every rank); with ``modifier_rank=None`` changes
    are discarded, as in DeepSpeed.  Parameters that are not sharded (stages 0-2) are broadcast from
    ``modifier_rank`` on exit.  The optimizer's fp32 masters follow the change.

    Before ``initialize``, on a model built under ``zero.Init()``: the parameters hold NaN inside the
    block (nothing is initialized yet); those written on ``modifier_rank`` (``load_state_dict``,
    ``copy_``, ``p.data[...] = ...``) replace their initializers' values at ``initialize``."""
    if isinstance(params, nn.Module):  # a module: all of its parameters
        params = list(params.parameters())
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if not enabled:
        yield
        return
    on_meta = [p for p in params if p.is_meta]
    if on_meta:
        with _gathered_before_initialize(on_meta, modifier_rank):
            yield
        return
    sharded = [p for p in params if isinstance(p, DTensor)]
    fulls = {id(p): _full_copy(p) for p in sharded}
    swapped = [p for p in sharded if _try_swap(p, fulls[id(p)])]
    owners = _owners([p for p in sharded if not any(p is q for q in swapped)])
    for p in sharded:  # not swappable (something else holds it): the modules hold the full value
        for module, name in owners.get(id(p), []):
            module._parameters[name] = fulls[id(p)]
    try:
        yield
    finally:
        for p in swapped:
            torch.utils.swap_tensors(p, fulls[id(p)])  # p is the sharded parameter again, fulls[] the value
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


class _Full(torch.Tensor):
    """A gathered parameter's value, laid out as a DTensor (same slots) so the two can swap places;
    torch functions on it give plain tensors (``p.data.cpu()`` is a full ``torch.Tensor``)."""

    __slots__ = ("_local_tensor", "_spec")
    __torch_function__ = torch._C._disabled_torch_function_impl


def _full_copy(p: DTensor) -> torch.Tensor:
    full = torch.Tensor._make_subclass(_Full, p.full_tensor().detach().clone(), p.requires_grad)
    full._is_param = True  # isinstance(p, nn.Parameter) holds inside the block
    # FSDP2 reads its shard off the parameter object when it gathers (a forward inside the block: TRL's
    # generation): once swapped, the object must still answer with the DTensor's shard and spec
    full._local_tensor, full._spec = p._local_tensor, p._spec
    _copy_ds_attributes(p, full, ZeroParamStatus.AVAILABLE)
    return full


def _try_swap(p: torch.Tensor, full: torch.Tensor) -> bool:
    try:
        torch.utils.swap_tensors(p, full)
    except (RuntimeError, TypeError):
        return False
    return True


@contextmanager
def _gathered_before_initialize(params: list[nn.Parameter], modifier_rank: int | None) -> Iterator[None]:
    """Meta parameters (``zero.Init()``, no ``initialize`` yet) become real NaN-filled tensors in place;
    on exit those ``modifier_rank`` wrote are recorded for ``materialize`` and the parameters go back
    to the meta device (no rank keeps a whole model besides the modifier's recorded values)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("zero.GatheredParameters() before deepspeed.initialize(): call "
                         "deepspeed.init_distributed() first (the written values are broadcast)")
    holders = {id(p): nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype), requires_grad=p.requires_grad)
               for p in params}
    owners = _owners(params)
    for p in params:
        torch.utils.swap_tensors(p, holders[id(p)])  # p is now real; holders[] keeps the meta tensor
    versions = {id(p): p._version for p in params}
    try:
        yield
    finally:
        rank = dist.get_rank() if world > 1 else 0
        keep = modifier_rank is not None and rank == modifier_rank
        values = {id(p): p.detach().clone() if keep else p.detach() for p in params}
        for p in params:
            written = p._version != versions[id(p)] or not bool(torch.isnan(values[id(p)]).all())
            torch.utils.swap_tensors(p, holders[id(p)])
            values[id(p)] = values[id(p)] if written else None
        if modifier_rank is not None:
            flags = torch.tensor([values[id(p)] is not None for p in params], dtype=torch.int32, device=local_device())
            if world > 1:
                dist.broadcast(flags, src=modifier_rank)
            for p, flag in zip(params, flags.tolist(), strict=True):
                if not flag:
                    continue
                kept = values[id(p)] if rank == modifier_rank else None
                for module, name in owners.get(id(p), []):
                    _WRITTEN.setdefault(module, {})[name] = (modifier_rank, kept)


_ENGINES: weakref.WeakSet = weakref.WeakSet()


def _sync_fp32_masters(params: list[nn.Parameter], modifier_rank: int | None) -> None:
    """Modified weights must reach the optimizer's fp32 masters too (engines register here)."""
    if modifier_rank is None or not params:
        return
    for engine in list(_ENGINES):
        engine.sync_masters_from_params(params)


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's: where a ZeRO-3 parameter's full value is (``p.ds_status``)."""

    AVAILABLE = 1  # gathered: the module computes with the full value
    NOT_AVAILABLE = 2  # only this rank's shard is held
    INFLIGHT = 3  # being gathered (never observed here: FSDP2 gathers inside its hooks)


_DS_IDS = itertools.count()
_DS_ATTRS = ("ds_id", "ds_shape", "ds_numel", "ds_tensor", "ds_persist", "ds_active_sub_modules")


def _copy_ds_attributes(src: torch.Tensor, dst: torch.Tensor, status: ZeroParamStatus) -> None:
    for name in _DS_ATTRS:
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))
    if hasattr(src, "ds_id"):
        dst.ds_status = status


def tag_zero3_params(model: nn.Module) -> None:
    """DeepSpeed's ZeRO-3 parameter attributes on the sharded parameters (what ``model.parameters()``
    and the optimizer hold): ``ds_id``, ``ds_shape``/``ds_numel`` (the full shape), ``ds_tensor`` (this
    rank's Shard(0) rows; DeepSpeed's is a flat padded partition), ``ds_status`` NOT_AVAILABLE.  The
    gathered parameters FSDP2 puts in the modules during forward/backward get the same attributes with
    ``ds_status`` AVAILABLE (a forward pre-hook that runs after FSDP2's all-gather)."""
    owners: dict[tuple[int, str], torch.Tensor] = {}
    for module in model.modules():
        mine = False
        for name, p in module._parameters.items():
            if p is None or not isinstance(p, DTensor):
                continue
            mine = True
            if not hasattr(p, "ds_id"):
                p.ds_id = next(_DS_IDS)
                p.ds_shape = torch.Size(p.shape)
                p.ds_numel = p.numel()
                p.ds_tensor = p.to_local()
                p.ds_persist = False
                p.ds_active_sub_modules = set()  # always empty: FSDP2 gathers per unit, not per submodule
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            owners[(id(module), name)] = p
        if mine:
            module.register_forward_pre_hook(partial(_tag_gathered, owners))
    # the root unit's parameters (embeddings, head) stay gathered for the whole forward: tagged when it
    # starts, for code that reads one before its module's own forward (TRL's fused lm_head loss)
    tagged = [m for m in model.modules() if any((id(m), n) in owners for n in m._parameters)]
    model.register_forward_pre_hook(lambda _model, args: [_tag_gathered(owners, m, args) for m in tagged] and None)


def fsdp_lazy_init(model: nn.Module) -> None:
    """FSDP2's lazy initialization now rather than at the first forward: ``GatheredParameters`` swaps full
    values into the sharded parameter objects, and that first-forward initialization reads them as DTensors
    (TRL's GRPO generates inside ``GatheredParameters`` before any training forward).  FSDP2 offers no
    public call for it; its root state's ``_lazy_init`` is what the first forward runs, and is idempotent."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model._get_fsdp_state()._lazy_init()


def _tag_gathered(owners: dict[tuple[int, str], torch.Tensor], module: nn.Module, args: Any) -> None:
    for name, p in module._parameters.items():
        sharded = owners.get((id(module), name))
        if p is not None and sharded is not None and p is not sharded and not hasattr(p, "ds_id"):
            _copy_ds_attributes(sharded, p, ZeroParamStatus.AVAILABLE)


_EXTERNAL: weakref.WeakKeyDictionary[nn.Module, list[nn.Parameter]] = weakref.WeakKeyDictionary()


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's: ``parameter`` (owned by another module) is used in ``module``'s forward.

    FSDP2 keeps the root unit's parameters (those outside every block: embeddings, heads, ...)
    gathered through the whole forward, so such a use needs nothing.  A parameter owned by a block
    and used outside it is only gathered during that block's forward: ``deepspeed.initialize``
    refuses it at ZeRO-3, naming it (move it to the model's root, outside the blocks).
    """
    if not isinstance(parameter, torch.Tensor):
        raise ValueError(f"register_external_parameter(module, {type(parameter).__name__}): expected a parameter")
    _EXTERNAL.setdefault(module, []).append(parameter)


def external_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters registered as used in ``module``'s forward (``register_external_parameter``)."""
    return list(_EXTERNAL.get(module, []))


def check_external_parameters(model: nn.Module, blocks: Iterable[nn.Module]) -> None:
    """At ZeRO-3: every registered external parameter must be gathered whenever its user runs."""
    owner_block: dict[int, str] = {}
    for i, block in enumerate(blocks):
        for name, p in block.named_parameters():
            owner_block[id(p)] = f"block {i} ({name})"
    users = {id(m): m for m in model.modules()}
    for module, external in list(_EXTERNAL.items()):
        if id(module) not in users:
            continue
        for p in external:
            where = owner_block.get(id(p))
            inside = where is not None and any(p is q for q in module.parameters())
            if where is not None and not inside:
                raise ValueError(f"zero.register_external_parameter({type(module).__name__}, <param of {where}>): "
                                 f"at ZeRO-3 a block's parameters are gathered only during that block's forward; "
                                 f"move the shared parameter out of the blocks (to the model's root module)")
