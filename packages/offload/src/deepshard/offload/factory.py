"""The one entry point the app uses: a typed config in, a StateStore constructor out."""

from __future__ import annotations

import torch

from deepshard.core.state_store import DeviceStateStore, StateStore, StoreFactory
from deepshard.core.update_rule import UpdateRule
from deepshard.core.zero import CpuParamOffload, ParamOffload

from .config import OffloadConfig, validate_config
from .cpu_store import CpuStateStore
from .infinity_store import InfinityStore
from .nvme_store import NvmeStateStore
from .param_swap import ParamSwap


class InfinityFactory:
    """``offload.params=nvme``: the store factory and, as :attr:`param_swap`, the object core's
    ``initialize(offload_params=...)`` hooks into the FSDP units (see :func:`param_offload`)."""

    def __init__(self, config: OffloadConfig, rank: int, run_id: str) -> None:
        self.param_swap = ParamSwap(config, rank=rank, run_id=run_id)

    def __call__(self, params: list[torch.Tensor], weight_decays: list[float], rule: UpdateRule, *,
                 masters: list[torch.Tensor] | None = None) -> StateStore:
        assert masters is None, "ZeRO-3 params are never cast before sharding: they are their own masters"
        return InfinityStore(params, weight_decays, rule, swap=self.param_swap)


def make_store_factory(config: OffloadConfig, rank: int, run_id: str) -> StoreFactory:
    """Validate ``config`` now (before any model is built) and return the store constructor core calls.

    ``run_id`` names the launcher's run (its run id or pid) so swap dirs of a crashed run can be
    found and removed by :func:`deepshard.offload.remove_scratch`.  Space and buffer-size checks
    that need the shard sizes run when the store is built, still before the first step.
    """
    validate_config(config)
    if config.device == "none":
        return DeviceStateStore
    if config.device == "cpu":
        return CpuStateStore
    if config.params == "nvme":
        return InfinityFactory(config, rank, run_id)

    def nvme(params: list[torch.Tensor], weight_decays: list[float], rule: UpdateRule, *,
             masters: list[torch.Tensor] | None = None) -> StateStore:
        return NvmeStateStore(params, weight_decays, rule, config=config, rank=rank, run_id=run_id, masters=masters)

    return nvme


def param_offload(config: OffloadConfig, store_factory: StoreFactory) -> ParamOffload | None:
    """What to pass as core's ``initialize(offload_params=...)``: None, core's ``CpuParamOffload``
    (``params=cpu``: FSDP2's CPU offload) or the :class:`ParamSwap` of ``store_factory`` (``params=nvme``)."""
    if config.params == "nvme":
        assert isinstance(store_factory, InfinityFactory), "params=nvme needs make_store_factory's factory"
        return store_factory.param_swap
    return CpuParamOffload() if config.params == "cpu" else None
