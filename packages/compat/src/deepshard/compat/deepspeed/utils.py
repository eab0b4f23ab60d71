"""``deepspeed.utils``: ``RepeatingLoader``, ``logger``/``log_dist`` and the ``safe_get_*`` accessors
of a parameter's fp32 master, gradient and optimizer state.

The accessors find the parameter in an engine built by ``deepspeed.initialize`` and read the
optimizer's state store.  ``full`` variants are collectives at ZeRO 1-3 (every dp rank calls, as in
DeepSpeed) and return the whole tensor on every rank; ``local`` variants return this rank's
Shard(0) rows.  Unlike DeepSpeed, they answer at every stage (DeepSpeed returns None for a plain
fp32 stage-0 optimizer); for a parameter no engine trains they return None, as DeepSpeed does.
Gradients are readable between the accumulation boundary's ``backward`` and ``step`` (DeepSpeed's
window), loss scale removed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from . import groups  # noqa: F401 - deepspeed.utils.groups (DeepSpeed's expert / data-parallel groups)

logger = logging.getLogger("DeepSpeed")
STATE_KEYS = ("exp_avg", "exp_avg_sq")


class RepeatingLoader:
    """DeepSpeed's: iterate ``loader`` forever, restarting it when it is exhausted."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            batch = next(self.data_iter)
        return batch


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log ``message`` on the given ranks (all with ``[-1]``; rank 0 when None), DeepSpeed's format."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    ranks = [0] if ranks is None else ranks
    if -1 in ranks or rank in ranks:
        logger.log(level, f"[Rank {rank}] {message}")


def _locate(param: torch.Tensor) -> tuple[Any, int] | None:
    """(the DeepSpeedEngine training ``param``, its index in the stage's parameter list)."""
    from .zero import _ENGINES

    for ds_engine in list(_ENGINES):
        for i, p in enumerate(ds_engine.engine.stage.params):
            if p is param:
                return ds_engine, i
    return None


def _rows(num_rows: int, world: int, rank: int) -> slice:
    """``rank``'s Shard(0) rows (torch.chunk / DTensor / deepshard's stages 1-3 agree)."""
    per = -(-num_rows // world)
    start = min(rank * per, num_rows)
    return slice(start, min(start + per, num_rows))


def _sharded(ds_engine: Any, param: torch.Tensor) -> bool:
    return ds_engine.engine.stage.zero_stage > 0 and param.dim() > 0


def _full(ds_engine: Any, param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if not _sharded(ds_engine, param):
        return local.detach().clone()
    mesh = param.device_mesh if isinstance(param, DTensor) else ds_engine.engine.mesh["dp"]
    shape = torch.Size(param.shape)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.detach(), mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=stride).full_tensor()


def _local_part(ds_engine: Any, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"safe_set_full_*: value of shape {tuple(value.shape)} for a parameter of shape "
                         f"{tuple(param.shape)}")
    if not _sharded(ds_engine, param):
        return value
    dp = ds_engine.engine.mesh["dp"]
    return value[_rows(param.shape[0], dp.size(), dp.get_local_rank())]


def _state(param: torch.Tensor, key: str) -> tuple[Any, int, torch.Tensor] | None:
    found = _locate(param)
    if found is None:
        return None
    ds_engine, i = found
    return ds_engine, i, ds_engine.engine.optimizer.store.state_dict()[key][i]


def _check_key(key: str) -> str:
    if key not in STATE_KEYS:
        raise ValueError(f"optim_state_key={key!r}: valid keys are {', '.join(STATE_KEYS)} (Adam's moments)")
    return key


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master of ``param`` (collective at ZeRO 1-3)."""
    found = _state(param, "master")
    return None if found is None else _full(found[0], param, found[2]).float()


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole ``exp_avg`` / ``exp_avg_sq`` of ``param`` (collective at ZeRO 1-3)."""
    found = _state(param, _check_key(optim_state_key))
    return None if found is None else _full(found[0], param, found[2])


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole averaged gradient of ``param``, between the boundary's backward and step (collective at 1-3)."""
    found = _locate(param)
    if found is None:
        return None
    ds_engine, i = found
    engine = ds_engine.engine
    local = engine.stage.local_grads()[i].float() / engine.scaler.scale
    return _full(ds_engine, param, local)


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's rows of the fp32 master (the whole master at ZeRO-0)."""
    found = _state(param, "master")
    return None if found is None else found[2].detach().float().clone()


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    found = _state(param, _check_key(optim_state_key))
    return None if found is None else found[2].detach().clone()


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    found = _locate(param)
    if found is None:
        return None
    engine = found[0].engine
    return engine.stage.local_grads()[found[1]].float() / engine.scaler.scale


def _set(param: torch.Tensor, value: torch.Tensor, key: str) -> None:
    found = _locate(param)
    if found is None:
        return
    ds_engine, i = found
    engine = ds_engine.engine
    store = engine.optimizer.store
    state = store.state_dict()
    with torch.no_grad():
        state[key][i].copy_(_local_part(ds_engine, param, value.detach()).to(state[key][i]))
    store.load_state_dict(state)  # params follow the masters (this rank's rows)
    if key == "master":
        engine.stage.after_step()  # ZeRO 1-2: all-gather the rows back into the replicated params
        engine.stage.gather_params()


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace ``param``'s fp32 master (and the parameter) by the whole ``value`` (collective at 1-2)."""
    _set(param, value, "master")


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    _set(param, value, _check_key(optim_state_key))


__all__ = ["RepeatingLoader", "log_dist", "logger", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_optimizer_state"]
